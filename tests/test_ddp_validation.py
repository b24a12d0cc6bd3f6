"""Validation over data-parallel ranks: each rank encodes its part of the validation split and scores
its part of the captions; every rank gets the metrics of one process (issue 38: "Validation encodes
on all ranks and scores once").

- the ranks' share of the scoring (``compute_ranks(share=...)``), simulated with threads, gives the
  ranks a brute-force numpy count gives, ties included;
- on real gloo groups of 2 (and 3, slow) ranks, ``trainer.validate`` of VSE++ and SAF in float64
  equals one process's metrics, and each rank encoded only its contiguous part of the images and
  captions (the parts add up to the split: nothing is encoded twice).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.train.distributed import Group
from vsekit.train.evaluation import compute_ranks

sys.path.insert(0, str(Path(__file__).parent))
import ddp_harness as H  # noqa: E402


def brute_ranks(S: np.ndarray, cap_img: np.ndarray):
    """Image→text: non-matching captions scoring >= the image's best caption; text→image:
    non-matching images scoring >= the caption's own image."""
    n_img, n_cap = S.shape
    match = cap_img[None, :] == np.arange(n_img)[:, None]
    best = np.where(match, S, -np.inf).max(1)
    i2t = ((S >= best[:, None]) & ~match).sum(1)
    own = S[cap_img, np.arange(n_cap)]
    t2i = ((S >= own[None, :]) & ~match).sum(0)
    return i2t, t2i


class ThreadShare:
    """A rank of ``world`` simulated by a thread: its part as ``Group.part``; reductions over the threads."""

    def __init__(self, rank: int, world: int, board: dict):
        self.group, self.board = Group(rank=rank, world=world), board

    def part(self, n: int) -> slice:
        return self.group.part(n)

    def reduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        self.board["slots"][self.group.rank] = np.array(array, copy=True)
        self.board["barrier"].wait()
        out = (np.max if op == "max" else np.sum)(np.stack(self.board["slots"]), axis=0)
        self.board["barrier"].wait()
        return out


@pytest.mark.parametrize("world", [2, 3, 5])
def test_each_rank_scores_its_captions_and_the_reduced_ranks_are_the_brute_force_ranks(world):
    rng = np.random.default_rng(world)
    n_img, per = 9, 3
    cap_img = np.repeat(np.arange(n_img), per)
    rng.shuffle(cap_img)
    S = rng.integers(0, 6, (n_img, len(cap_img))).astype(np.float32)   # few values: many ties

    def scorer(img_sel, cap_sel):
        return torch.from_numpy(S[img_sel][:, cap_sel])

    board = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    results: dict[int, tuple] = {}
    calls: dict[int, set] = {r: set() for r in range(world)}

    def run(r):
        def counting(img_sel, cap_sel):
            calls[r].update(np.arange(len(cap_img))[cap_sel].tolist())
            return scorer(img_sel, cap_sel)
        results[r] = compute_ranks(counting, n_img, cap_img, max_elements=20, share=ThreadShare(r, world, board))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = brute_ranks(S, cap_img)
    for r in range(world):
        np.testing.assert_array_equal(results[r][0], want[0])
        np.testing.assert_array_equal(results[r][1], want[1])
        part = Group(rank=r, world=world).part(len(cap_img))
        assert calls[r] == set(range(part.start, part.stop))   # a rank scores only its captions
    np.testing.assert_array_equal(compute_ranks(scorer, n_img, cap_img, max_elements=20)[0], want[0])


@pytest.fixture(scope="module")
def val_store(tmp_path_factory):
    return H.make_val_store(str(tmp_path_factory.mktemp("val") / "s.zarr"))


@pytest.fixture(scope="module")
def one_process(val_store):
    from vsekit.train.distributed import SINGLE

    torch.set_num_threads(1)
    return {name: H.validate_case(val_store, name, SINGLE) for name in H.VAL_MODELS}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_validation_over_ranks_is_one_process_validation_with_each_item_encoded_once(val_store, one_process,
                                                                                      world, tmp_path):
    ranks = H.spawn_validate(world, str(tmp_path), val_store)
    for name, ref in one_process.items():
        assert ref["images"] == ref["n_images"] == 7 and ref["captions"] == ref["n_captions"] == 21
        assert ref["metrics"]["rsum"] > 0
        sizes_i = Group(world=world).sizes(ref["n_images"])
        sizes_c = Group(world=world).sizes(ref["n_captions"])
        for r, res in enumerate(ranks):
            got = res[name]
            assert got["images"] == sizes_i[r] and got["captions"] == sizes_c[r], (name, r, got)
            for k, v in ref["metrics"].items():
                assert got["metrics"][k] == pytest.approx(v, rel=1e-12, abs=1e-12), (name, r, k)
