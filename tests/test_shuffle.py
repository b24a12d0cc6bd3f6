"""The training shuffle: a global permutation of the split's pairs whenever its decoded rows fit the
memory budget (as the reference loaders shuffle), windows of chunks otherwise; every epoch a
permutation of the split's pairs either way."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vsekit.storage import FeatureStore  # noqa: E402
from vsekit.train.data import FeatureSource, PairStream, Tokens, window_chunks_for  # noqa: E402

ROWS, CHUNK, WIDTH = 120, 4, 6        # 30 chunks of 4 rows, 6 float32 per row (24 bytes)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """120 images with 1-3 captions each; feature row i holds the value i (so batches show rows)."""
    from vsekit.tokenize import tokenize

    d = tmp_path_factory.mktemp("shuffle")
    st = FeatureStore.create(d / "s.zarr", dataset="t")
    rng = np.random.default_rng(0)
    n_caps = rng.integers(1, 4, ROWS)
    st.write_images([f"i{k}" for k in range(ROWS)], [f"i{k}.jpg" for k in range(ROWS)], ["train"] * ROWS)
    cap_img = np.repeat(np.arange(ROWS), n_caps)
    st.write_captions([f"a photo of thing {i} number {j}" for j, i in enumerate(cap_img)], cap_img)
    tokenize(st, min_count=1)
    fs = st.create_features("f", (WIDTH,), "float32", block_rows=CHUNK, attrs={"kind": "global"})
    for blk in fs.blocks():
        rows = np.arange(blk.start, blk.stop, dtype=np.float32)
        fs.write_block(blk, np.repeat(rows[:, None], WIDTH, 1))
    return st


def stream(store, **kw):
    return PairStream(FeatureSource(store.features("f")), Tokens.from_store(store), store.split_rows("train"),
                      store.caption_images(), **kw)


def test_window_size_from_the_budget_by_hand():
    # 10 chunks of 100 rows of 400 bytes: 400 kB in all, plus 8 head rows
    chunks = [100] * 10
    assert window_chunks_for(chunks, 400, (1000 + 8) * 400, head_rows=8) == 10        # fits: one window
    # 1 byte short: two buffers of half the budget, 503 rows each, 8 of them head: 4 chunks
    assert window_chunks_for(chunks, 400, (1000 + 8) * 400 - 1, head_rows=8) == 4
    assert window_chunks_for(chunks, 400, 2 * 407 * 400, head_rows=8) == 3            # 2 x (8 + 399 rows)
    assert window_chunks_for(chunks, 400, 10, head_rows=8) == 1                        # at least one chunk
    assert window_chunks_for([], 400, 10) == 1


def epoch_pairs(s, epoch=0):
    batches = list(s.epoch(epoch))
    for b in batches:   # the features are the rows of the batch's images
        np.testing.assert_array_equal(b.feats[:, 0].numpy(), b.images.numpy())
    return batches


@pytest.mark.parametrize("captions", ["one", "all"])
def test_a_split_within_the_budget_is_one_global_permutation(store, captions):
    s = stream(store, batch_size=16, captions=captions, seed=3)    # default budget: 4 GB, the set is 3 kB
    assert s.global_shuffle and s.window_chunks == ROWS // CHUNK
    batches = epoch_pairs(s)
    imgs = np.concatenate([b.images.numpy() for b in batches])
    cap_img = store.caption_images()
    if captions == "one":
        assert sorted(imgs.tolist()) == list(range(ROWS))           # each image once: a permutation
    else:
        assert sorted(imgs.tolist()) == sorted(cap_img.tolist())    # each pair once
    # the first batch draws from all over the set, not from a few chunks: with 30 chunks and 16 pairs
    # it spans more chunks than the 8-chunk window the trainer used to read
    assert len(set((batches[0].images.numpy() // CHUNK).tolist())) > 8


def test_a_split_over_the_budget_is_shuffled_in_windows(store):
    row_bytes = WIDTH * 4
    budget = 2 * (16 + 6 * CHUNK) * row_bytes            # two buffers of the head and 6 chunks
    s = stream(store, batch_size=16, captions="one", seed=3, shuffle_memory=budget)
    assert not s.global_shuffle and s.window_chunks == 6
    batches = epoch_pairs(s)
    imgs = np.concatenate([b.images.numpy() for b in batches])
    assert sorted(imgs.tolist()) == list(range(ROWS))
    # the first batch comes from the first window (24 pairs): at most 6 chunks
    assert len(set((batches[0].images.numpy() // CHUNK).tolist())) <= 6
    # one read-ahead buffer and one being consumed, each within half the budget
    assert len(s._bufs) == 2 and all(f.nbytes <= budget // 2 for f, _ in s._bufs)


def test_global_shuffle_keeps_one_buffer(store):
    s = stream(store, batch_size=16, captions="all")
    epoch_pairs(s)
    assert len(s._bufs) == 1 and len(s._bufs[0][0]) == 16 + ROWS


def test_the_trainer_passes_the_budget(store, tmp_path):
    from vsekit.train import trainer
    from vsekit.train.config import TrainConfig

    seen = {}
    real = trainer.PairStream

    def spy(*a, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    trainer.PairStream = spy
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            trainer.train(str(store.path), "f", "vse", tmp_path / "run", presets=["demo"], progress=False,
                          epochs=1, embed_dim=8, word_dim=8, shuffle_memory_gb=0.5, val_split="train")
    finally:
        trainer.PairStream = real
    assert seen["shuffle_memory"] == 0.5 * 2**30 and seen["window_chunks"] is None
    assert TrainConfig().shuffle_memory_gb == 4.0 and TrainConfig().window_chunks is None
