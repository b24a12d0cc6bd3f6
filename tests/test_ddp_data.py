"""Each data-parallel rank's share of the epoch stream (``PairStream.epoch_part``).

The ranks' parts, put together, are exactly one process's batches (features, counts, tokens at the
global batch's width, lengths; every rank sees the whole batch's image ids), in a global shuffle
and in small windows, from the start and after skipping batches (a mid-epoch resume); a rank keeps
about 1 / ranks of a window's rows in memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_region_store


@pytest.fixture(scope="module")
def stream_parts(tmp_path_factory):
    from vsekit.storage.store import FeatureStore
    from vsekit.train.data import PairStream, Tokens, open_features, usable_rows

    path = make_region_store(tmp_path_factory.mktemp("parts") / "s.zarr", n_train=70, n_val=4, per_image=3,
                             regions=4, channels=3)
    store = FeatureStore.open(path)
    rows = usable_rows(store, open_features(store, "regions", store.split_rows("train")), "train")
    source = open_features(store, "regions", rows)
    tokens = Tokens.from_store(store)

    def make(window_chunks, captions="all"):
        return PairStream(source, tokens, rows, store.caption_images(), batch_size=12, captions=captions,
                          window_chunks=window_chunks, seed=5)
    return make


@pytest.mark.parametrize("window_chunks", [1, None], ids=["windows", "global"])
@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("skip", [0, 4])
def test_parts_make_the_one_process_batches(stream_parts, window_chunks, world, skip):
    whole = list(stream_parts(window_chunks).epoch(2, skip=skip))
    parts = [list(stream_parts(window_chunks).epoch_part(2, r, world, skip=skip)) for r in range(world)]
    assert len(whole) == len(stream_parts(window_chunks)) - skip and all(len(p) == len(whole) for p in parts)
    assert len(whole[-1].images) < 12           # the epoch's short last batch is split too
    for i, batch in enumerate(whole):
        got = [p[i] for p in parts]
        n = len(batch.images)
        for g in got:
            assert torch.equal(g.images, batch.images)
            assert g.tokens.shape[1] == batch.tokens.shape[1]     # the global batch's width
        if n < world:
            cat = got[0]
        else:
            assert [g.part for g in got] == [slice(g.part.start, g.part.stop) for g in got]
            assert sum(g.part.stop - g.part.start for g in got) == n
            cat = type(batch)(*(torch.cat([getattr(g, k) for g in got]) for k in ("feats", "counts", "tokens",
                                                                                  "lengths", "images")[:4]),
                              batch.images)
        assert torch.equal(cat.feats, batch.feats)
        assert torch.equal(cat.counts, batch.counts)
        assert torch.equal(cat.tokens, batch.tokens)
        assert torch.equal(cat.lengths, batch.lengths)


def test_a_rank_keeps_its_share_of_a_window(stream_parts):
    """One caption per image: a rank holds its 1/4 of a window's rows (and the pairs carried over).
    Every caption (3 per image here): a rank holds the images of its quarter of the pairs, which
    is more than a quarter of the images (docs/train.md says how much)."""
    s = stream_parts(2, captions="one")
    whole_rows = max(sum(b - a for a, b in plan["window"]) for plan in s._plans(1))
    assert list(s.epoch_part(1, 0, 4))
    assert s.part_rows_peak <= whole_rows / 4 + 12          # its quarter, and the pairs carried over
    s = stream_parts(2, captions="all")
    assert list(s.epoch_part(1, 0, 4))
    assert whole_rows / 4 < s.part_rows_peak <= whole_rows


# the window shared by the ranks of a node (PairStream.epoch_shared) -------------------------------
class ThreadGroup:
    """The collectives NodeShare uses, for ranks simulated by threads of one process."""

    def __init__(self, rank: int, world: int, board: dict, local_world: int | None = None):
        self.rank, self.world = rank, world
        local_world = local_world or world
        self.local_rank = rank % local_world
        self.main = rank == 0
        self.board = board
        self.barriers = 0

    def barrier(self, what: str = "") -> None:
        self.barriers += 1
        self.board["barrier"].wait(60)

    def broadcast_object(self, obj):
        if self.main:
            self.board["obj"] = obj
        self.board["barrier"].wait(60)
        out = self.board["obj"]
        self.board["barrier"].wait(60)
        return out

    def any(self, flag: bool) -> bool:
        self.board["flags"][self.rank] = bool(flag)
        self.board["barrier"].wait(60)
        out = any(self.board["flags"])
        self.board["barrier"].wait(60)
        return out


def run_shared(stream_parts, world, shm_dir, *, window_chunks=1, skip=0, local_world=None, room=None):
    import threading

    from vsekit.train.distributed import NodeShare

    board = {"barrier": threading.Barrier(world), "flags": [False] * world}
    out, streams, nodes, errors = {}, {}, {}, []

    def run(r):
        try:
            s = streams[r] = stream_parts(window_chunks)
            s.source = _counting(s.source)   # this rank's reads of the store, as they happen
            node = nodes[r] = NodeShare(ThreadGroup(r, world, board, local_world), shm_dir)
            if room is not None:
                node._room = lambda nbytes, r=r: room(r)
            batches = s.epoch_shared(2, r, world, node, skip=skip)
            first = next(batches)
            s.folder_at_first_batch = sorted(p.name for p in Path(shm_dir).iterdir()) if Path(shm_dir).is_dir() else []
            out[r] = [first, *batches]
        except BaseException as exc:   # noqa: BLE001 (reported below)
            errors.append(exc)
            board["barrier"].abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out, streams, nodes


def _counting(source):
    """A copy of ``source`` that counts the chunks it reads from the store (``reads``)."""
    import copy

    counted = copy.copy(source)
    counted.reads = 0
    read, read_into = source.read, source.read_into

    def count_read(start, stop):
        counted.reads += 1
        return read(start, stop)

    def count_read_into(start, stop, *a, **kw):
        counted.reads += 1
        return read_into(start, stop, *a, **kw)

    counted.read, counted.read_into = count_read, count_read_into
    return counted


def _same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.part == y.part
        for k in ("feats", "counts", "tokens", "lengths", "images"):
            assert torch.equal(getattr(x, k), getattr(y, k)), k


@pytest.mark.parametrize("window_chunks", [1, None], ids=["windows", "global"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("skip", [0, 4])
def test_a_shared_window_gives_each_rank_its_parts_and_is_read_once_per_node(stream_parts, tmp_path,
                                                                            window_chunks, world, skip):
    out, streams, nodes = run_shared(stream_parts, world, tmp_path, window_chunks=window_chunks, skip=skip)
    n_chunks = sum(len(p["window"]) for p in streams[0]._plans(2))
    for r in range(world):
        # exactly the rows epoch_part gives (whose parts make one process's batches, tested above)
        _same_batches(out[r], list(stream_parts(window_chunks).epoch_part(2, r, world, skip=skip)))
        assert nodes[r].fallback is None
        # the leader read every chunk of the epoch once from the store; the other ranks read nothing
        assert streams[r].source.reads == (n_chunks if r == 0 else 0)
        assert not hasattr(streams[r], "part_rows_peak")
        # the buffers' names are gone before the first batch (a run killed from then on leaves nothing)
        assert streams[r].folder_at_first_batch == []
    assert list(tmp_path.iterdir()) == []


def test_each_node_has_its_leader(stream_parts, tmp_path):
    """4 ranks on 2 nodes of 2: local ranks 0 (global 0 and 2) read; here both 'nodes' share one
    folder, so each leader's buffers are separate files."""
    out, streams, nodes = run_shared(stream_parts, 4, tmp_path, local_world=2)
    n_chunks = sum(len(p["window"]) for p in streams[0]._plans(2))
    assert [streams[r].source.reads for r in range(4)] == [n_chunks, 0, n_chunks, 0]
    for r in range(4):
        _same_batches(out[r], list(stream_parts(1).epoch_part(2, r, 4)))


def test_without_room_on_any_node_every_rank_falls_back_to_its_own_rows(stream_parts, tmp_path):
    out, streams, nodes = run_shared(stream_parts, 2, tmp_path,
                                     room=lambda r: "no room" if r == 1 else None)
    for r in range(2):
        assert nodes[r].fallback in ("no room", "another node's shared-memory folder lacks room")
        _same_batches(out[r], list(stream_parts(1).epoch_part(2, r, 2)))
        assert streams[r].part_rows_peak > 0 and streams[r].source.reads > 0   # each rank reads for itself
    assert list(tmp_path.iterdir()) == []


def test_the_room_check_names_the_folder_and_the_sizes(tmp_path):
    from vsekit.train.distributed import NodeShare

    node = NodeShare(ThreadGroup(0, 1, {}), tmp_path / "missing")
    assert "not a writable folder" in node._room(1) and "missing" in node._room(1)
    node = NodeShare(ThreadGroup(0, 1, {}), tmp_path)
    why = node._room(1 << 60)
    assert str(tmp_path) in why and "GiB free" in why
    assert node._room(1) is None
