"""Each data-parallel rank's share of the epoch stream (``PairStream.epoch_part``).

The ranks' parts, put together, are exactly one process's batches (features, counts, tokens at the
global batch's width, lengths; every rank sees the whole batch's image ids), in a global shuffle
and in small windows, from the start and after skipping batches (a mid-epoch resume); a rank keeps
about 1 / ranks of a window's rows in memory.
"""

from __future__ import annotations

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
