"""The training stream over a store: pairs, chunk-aware shuffling, padding, FNE decoding."""

import numpy as np
import pytest
import torch

from vsekit.train.data import EvalSet, FeatureSource, PairStream, Tokens, image_batches, open_features


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

    def read_into(self, start, stop, out, counts_out=None):
        CountingSource.reads += 1
        return super().read_into(start, stop, out, counts_out)


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


def test_raw_chunk_reads_equal_zarr_and_compressed_sets_use_zarr(demo_store, tmp_path):
    """Float32 vector sets are stored raw and read straight from their chunk files; the result must
    be what zarr reads, for a full chunk, the short last chunk and a chunk never written (fill 0)."""
    from zarr.codecs import ZstdCodec

    from vsekit.storage import StoreError
    from vsekit.storage.store import default_compressors

    assert default_compressors((5,), "float32", "global") is None
    assert default_compressors((7, 7, 5), "float32", "grid") == "auto"
    assert default_compressors((5,), "int8", "fne") == "auto" and default_compressors((5,), "float32", "fne") == "auto"
    rng = np.random.default_rng(0)
    vals = rng.normal(size=(demo_store.n_images, 6)).astype(np.float32)
    raw = demo_store.create_features("raw", (6,), "float32", block_rows=5, attrs={"kind": "global"})
    packed = demo_store.create_features("z", (6,), "float32", block_rows=5, attrs={"kind": "global"},
                                        compressors=[ZstdCodec(level=0)])
    assert len(raw.data.metadata.codecs) == 1 and len(packed.data.metadata.codecs) == 2
    for blk in raw.blocks():
        if blk.start != 10:  # rows 10..14 never written
            raw.write_block(blk, vals[blk.start:blk.stop])
            packed.write_block(blk, vals[blk.start:blk.stop])
    src, zsrc = FeatureSource(raw), FeatureSource(packed)
    assert src.reader.raw_file(0, 5) is not None and src.reader.raw_file(20, 24) is not None
    assert src.reader.raw_file(1, 5) is None and src.reader.raw_file(0, 4) is None  # not a whole chunk
    assert zsrc.reader.raw_file(0, 5) is None
    expect = vals.copy()
    expect[10:15] = 0
    for start, stop in src.chunks():
        for s in (src, zsrc):
            out = np.full((stop - start, 6), np.nan, np.float32)
            s.read_into(start, stop, out)
            np.testing.assert_array_equal(out, expect[start:stop])
            np.testing.assert_array_equal(out, np.asarray(raw.data[start:stop]))
    # a truncated chunk file is a damaged store, named as such
    path = src.reader.raw_file(5, 10)
    with open(path, "r+b") as f:
        f.truncate(8)
    with pytest.raises(StoreError, match="damaged"):
        src.read_into(5, 10, np.empty((5, 6), np.float32))


def test_region_counts_follow_their_rows_across_windows(demo_store):
    """Regions with per-row counts: every batch's features and counts are its images' rows, also
    for the pairs carried over from one window into the next."""
    from vsekit.tokenize import tokenize

    tokenize(demo_store, min_count=1)
    n = demo_store.n_images
    fs = demo_store.create_features("r", (3, 2), "float32", block_rows=3, attrs={"kind": "regions"},
                                    extra={"count": ((), "int32")})
    for blk in fs.blocks():
        rows = np.arange(blk.start, blk.stop, dtype=np.float32)
        fs.write_block(blk, np.broadcast_to(rows[:, None, None], (len(rows), 3, 2)).copy(),
                       count=(np.arange(blk.start, blk.stop) % 3) + 1)   # counts under the block's checksum
    rows = demo_store.split_rows("train")
    stream = PairStream(FeatureSource(fs), Tokens.from_store(demo_store), rows, demo_store.caption_images(),
                        batch_size=4, captions="all", window_chunks=2, seed=1)
    batches = list(stream.epoch(0))
    assert len(batches) == len(stream)
    seen = []
    for b in batches:
        img = b.images.numpy()
        np.testing.assert_array_equal(b.feats[:, 0, 0].numpy(), img)
        np.testing.assert_array_equal(b.counts.numpy(), img % 3 + 1)
        seen += img.tolist()
    assert sorted(seen) == sorted(demo_store.caption_images()[demo_store.captions_of_split("train")].tolist())


def test_the_store_side_chunk_reader_serves_checked_raw_reads(demo_store):
    """``storage.chunks.ChunkReader`` reads a raw float32 chunk file into the caller's buffer equal
    to zarr's rows, and refuses a block whose file was changed, by the raw path and the zarr path
    alike; the trainer's data module opens no chunk file and computes no checksum itself."""
    from vsekit.storage.base import StoreError
    from vsekit.storage.chunks import ChunkReader

    rng = np.random.default_rng(3)
    fs = demo_store.create_features("raw", (4,), "float32", block_rows=5, attrs={"kind": "global"})
    vals = rng.normal(size=(fs.n_rows, 4)).astype(np.float32)
    for blk in fs.blocks():
        fs.write_block(blk, vals[blk.start:blk.stop])
    reader = ChunkReader(fs)
    for start, stop in [(b.start, b.stop) for b in fs.blocks()]:
        path = reader.raw_file(start, stop)
        out = np.full((stop - start, 4), np.nan, np.float32)
        reader.read_raw(path, start, out)
        np.testing.assert_array_equal(out, vals[start:stop])
        reader.verify(start, stop)
    path = reader.raw_file(5, 10)
    with open(path, "r+b") as f:   # one float changed, same size: only the CRC-32 sees it
        f.seek(4)
        f.write(np.float32(123.0).tobytes())
    with pytest.raises(StoreError, match=r"block 1 \(rows 5-9\) is damaged .*CRC-32"):
        reader.read_raw(path, 5, np.empty((5, 4), np.float32))
    with pytest.raises(StoreError, match=r"block 1 \(rows 5-9\) is damaged .*CRC-32"):
        reader.verify(0, 10)
    with pytest.raises(StoreError, match="damaged"):
        FeatureSource(fs).read_into(5, 10, np.empty((5, 4), np.float32))

    import ast
    import inspect

    import vsekit.train.data as data

    tree = ast.parse(inspect.getsource(data))
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "open" not in called and not imported & {"crc_of", "BlockCheck", "ABSENT"}
