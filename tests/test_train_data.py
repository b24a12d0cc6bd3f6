"""The training stream over a store: pairs, chunk-aware shuffling, padding, FNE decoding."""

import numpy as np
import pytest
import torch

from vsekit.train.data import EvalSet, FeatureSource, PairStream, Tokens, _unpack_2bit, image_batches, open_features


@pytest.fixture()
def store(demo_store):
    from vsekit.tokenize import tokenize

    tokenize(demo_store, min_count=1)
    fs = demo_store.create_features("f", (3,), "float32", block_rows=4, attrs={"kind": "global"})
    for b in fs.blocks():
        rows = np.arange(b.start, b.stop)
        fs.write_block(b, np.stack([rows, rows * 10, -rows], axis=1).astype(np.float32))
    return demo_store


class CountingSource(FeatureSource):
    reads = 0

    def read(self, start, stop):
        CountingSource.reads += 1
        return super().read(start, stop)


def _stream(store, **kw):
    src = CountingSource(store.features("f"))
    rows = store.split_rows("train")
    return PairStream(src, Tokens.from_store(store), rows, store.caption_images(), **kw), rows


def test_one_caption_per_image_each_epoch(store):
    stream, rows = _stream(store, batch_size=5, captions="one", window_chunks=2)
    cap_img = store.caption_images()
    tokens = Tokens.from_store(store)
    CountingSource.reads = 0
    batches = list(stream.epoch(1))
    with_train = [c for c in stream.source.chunks() if np.isin(np.arange(*c), rows).any()]
    assert CountingSource.reads == len(with_train)  # each chunk with train rows read once, no row reads
    seen = np.concatenate([b.images.numpy() for b in batches])
    assert sorted(seen.tolist()) == sorted(rows.tolist())
    assert len(batches) == len(stream) and all(len(b.images) == 5 for b in batches[:-1])
    for b in batches:
        assert len(set(b.images.tolist())) == len(b.images)           # no image twice in a batch
        np.testing.assert_array_equal(b.feats[:, 0].numpy(), b.images.numpy())  # features of the row
        for tok, n, img in zip(b.tokens, b.lengths, b.images):
            assert (tok[n:] == 0).all() and (tok[:n] != 0).all()
            # the caption belongs to the image: find it among the image's captions
            caps = np.flatnonzero(cap_img == int(img))
            assert any(np.array_equal(tok[:n].numpy(), tokens.ids[tokens.offsets[c]:tokens.offsets[c + 1]])
                       for c in caps)


def test_all_captions_and_determinism(store):
    stream, rows = _stream(store, batch_size=7, captions="all", window_chunks=1)
    train_caps = store.captions_of_split("train")
    pairs = [b for b in stream.epoch(3)]
    n = sum(len(b.images) for b in pairs)
    assert n == len(train_caps) and len(pairs) == len(stream)
    again = [b.images.tolist() for b in stream.epoch(3)]
    assert again == [b.images.tolist() for b in pairs]
    assert again != [b.images.tolist() for b in stream.epoch(4)]


def test_tokens_batch_pads_and_keeps_length(store):
    tokens = Tokens.from_store(store)
    padded, lengths = tokens.batch(np.array([2, 0]))
    for row, c in enumerate([2, 0]):
        ids = tokens.ids[tokens.offsets[c]:tokens.offsets[c + 1]]
        assert lengths[row] == len(ids)
        assert padded[row, :len(ids)].tolist() == ids.tolist() and (padded[row, len(ids):] == 0).all()


def test_packed_fne_rows_decode_like_int8(demo_store):
    from vsekit.fne.pack import pack

    vals = np.random.default_rng(0).integers(-1, 2, size=(demo_store.n_images, 10)).astype(np.int8)
    a = demo_store.create_features("fne", (10,), "int8", block_rows=8, attrs={"kind": "fne"})
    b = demo_store.create_features("fnep", (3,), "uint8", block_rows=8,
                                   attrs={"kind": "fne", "packed": True, "n_features": 10})
    for blk in a.blocks():
        a.write_block(blk, vals[blk.start:blk.stop])
        b.write_block(blk, pack(vals[blk.start:blk.stop]))
    sa, sb = FeatureSource(a), FeatureSource(b)
    assert sb.row_shape == (10,) and sb.image_input == "global"
    np.testing.assert_array_equal(sa.read(0, 24)[0], vals.astype(np.float32))
    np.testing.assert_array_equal(sb.read(0, 24)[0], vals.astype(np.float32))
    np.testing.assert_array_equal(_unpack_2bit(pack(vals), 10), vals)  # the local fallback agrees


def test_eval_batches_and_pending_rows(store):
    src = FeatureSource(store.features("f"))
    es = EvalSet.from_store(store, "test", src)
    got = torch.cat([f for f, _ in image_batches(src, es.rows, 2)])
    assert got[:, 0].tolist() == es.rows.tolist()
    assert (es.rows[es.caption_image] == store.caption_images()[es.captions]).all()
    store.create_features("g", (3,), "float32", block_rows=4, attrs={"kind": "global"})
    from vsekit.storage import StoreError
    with pytest.raises(StoreError, match="pending"):
        open_features(store, "g", store.split_rows("train"))
