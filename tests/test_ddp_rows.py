"""Data-parallel steps send a word embedding's gradient only in the rows some rank's batch touched
(``step.reduce_touched_rows``, DDP's communication hook), and still equal one process's step.

On a real 2-rank gloo group, VSE++ and SAF in float64 with a vocabulary of 400 words whose batch
touches a few: rank 0's captions use words 1-9, rank 1's words 300-309, so a row touched on one
rank only must still arrive on the other. Every call of ``torch.distributed.all_reduce`` during the
step is recorded: the floating elements all-reduced are every other parameter's (and the batch-norm
sums of SAF's step, counted apart) plus the union of
the touched rows (counted from the batch's tokens, the padding row 0 excluded: its gradient is
zero), a tenth of the embedding or less; the gradients and the weights after Adam equal one
process's on both ranks, and ``Group.traffic`` counts the bytes that were sent.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # 8 s idle (two gloo ranks): over the 5-s rule

V, D = 400, 5
# name: (image features, factory arguments, the word embedding's parameter)
MODELS = {"vse": ((12,), {}, "txt_enc.embed.weight"), "saf": ((4, 6), {"dropout": 0.0, "sim_dim": 6}, "embed.weight")}
CAPTIONS = [[1, 2, 3, 0], [4, 5, 6, 7], [8, 9, 2, 0],          # rank 0's half
            [300, 301, 0, 0], [302, 303, 304, 305], [306, 307, 308, 309]]


def _batch(shape):
    from vsekit.train.data import Batch

    tokens = torch.tensor(CAPTIONS)
    rng = np.random.default_rng(3)
    feats = torch.from_numpy(rng.standard_normal((len(tokens), *shape)))
    counts = torch.full((len(tokens),), shape[0], dtype=torch.int64) if len(shape) == 2 else None
    return Batch(feats, counts, tokens, (tokens != 0).sum(1), torch.arange(len(tokens)))


def _step(name: str, group) -> dict:
    from vsekit.models import create_model
    from vsekit.models.losses import HingeLoss
    from vsekit.train.config import TrainConfig
    from vsekit.train.step import train_step

    shape, kwargs, _ = MODELS[name]
    torch.manual_seed(0)
    net = create_model(name, img_shape=shape, vocab_size=V, embed_dim=8, word_dim=D, **kwargs).double()
    net.train()
    optim = torch.optim.Adam(net.parameters(), lr=1e-2)
    calls = []
    import torch.distributed as dist

    plain = dist.all_reduce

    def counting(t, *args, **kwargs):
        calls.append((t.numel(), t.dtype))
        return plain(t, *args, **kwargs)

    # the batch-norm sums of a step (SAF) are all-reduced too, forward and backward: counted apart
    sums = []
    if group.distributed:
        group_reduce = group.all_reduce
        group.all_reduce = lambda t: sums.append(2 * t.numel()) or group_reduce(t)
    dist.all_reduce = counting
    try:
        before = group.traffic["reduce"]
        train_step(net, _batch(shape), HingeLoss(0.2, max_violation=True), optim, TrainConfig(model=name, grad_clip=2.0),
                   torch.device("cpu"), group)
    finally:
        dist.all_reduce = plain
        vars(group).pop("all_reduce", None)
    return {"calls": calls, "sums": sum(sums), "traffic": group.traffic["reduce"] - before, "sizes": {k: p.numel() for k, p in
            net.named_parameters()}, "grads": {k: p.grad.clone() for k, p in net.named_parameters() if p.grad is not None},
            "state": {k: v.clone() for k, v in net.state_dict().items()}}


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from vsekit.train.distributed import setup

    group = setup("cpu", timeout_s=60)
    try:
        torch.save({name: _step(name, group) for name in MODELS}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        group.close()


def test_only_touched_embedding_rows_are_sent_and_the_step_is_one_process_step(tmp_path):
    import torch.multiprocessing as mp

    from vsekit.train.distributed import SINGLE, free_port

    torch.set_num_threads(1)
    reference = {name: _step(name, SINGLE) for name in MODELS}
    mp.spawn(worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    touched = len({w for cap in CAPTIONS for w in cap} - {0})
    for name in MODELS:
        ref, table = reference[name], MODELS[name][2]
        assert ref["calls"] == [] and ref["traffic"] == 0, name     # one process: no collective
        others = sum(n for k, n in ref["sizes"].items() if k != table)
        assert ref["sizes"][table] == V * D
        for rank, res in enumerate(ranks):
            got = res[name]
            where = f"{name}, rank {rank}"
            floating = sum(n for n, dtype in got["calls"] if dtype == torch.float64)
            # + the step's stop flag (float64) + the batch-norm sums
            assert floating == others + touched * D + 1 + got["sums"], where
            assert touched * D <= V * D // 10, where
            assert [n for n, dtype in got["calls"] if dtype == torch.uint8] == [V], where   # rows' union, a byte each
            assert got["traffic"] == (others + touched * D + got["sums"]) * 8 + V, where
            assert set(got["grads"]) == set(ref["grads"]), where
            for k, g in ref["grads"].items():
                assert torch.allclose(got["grads"][k], g, rtol=1e-9, atol=1e-12), (where, k)
            for k, v in ref["state"].items():
                assert torch.allclose(got["state"][k], v, rtol=1e-9, atol=1e-9), (where, k)
        emb = ref["grads"][table]
        assert int(emb.ne(0).any(1).sum()) == touched, name         # the batch's words have gradients, no other row
