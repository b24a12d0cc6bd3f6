"""The trainer's reads from a store on object storage (issue 35), against a local S3 server (moto):
the same batches, bit for bit, as from the same set on disk; each block one GET per array, checked
against its commit record; and the window's blocks read with several requests in flight, never more
than the bound (counted at the server)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from vsekit.storage.base import StoreError  # noqa: E402
from vsekit.storage.store import FeatureStore  # noqa: E402
from vsekit.train.data import FeatureSource, PairStream, Tokens, image_batches  # noqa: E402

pytestmark = pytest.mark.e2e

N, BLOCK = 40, 4     # 10 blocks


def _write(store: FeatureStore, kind: str, seed: int = 0) -> str:
    """The same feature set (by ``seed``) in ``store``: global float32 (stored raw), FNE int8, packed
    FNE or regions with a per-row count (zstd)."""
    rng = np.random.default_rng(seed)
    with store.writer(kind, stage="test"):
        if kind == "global":
            fs = store.create_features(kind, (6,), "float32", attrs={"kind": "global"}, block_rows=BLOCK)
            rows = rng.standard_normal((N, 6)).astype(np.float32)
        elif kind == "fne":
            fs = store.create_features(kind, (9,), "int8", attrs={"kind": "fne"}, block_rows=BLOCK)
            rows = rng.integers(-1, 2, (N, 9)).astype(np.int8)
        elif kind == "packed":   # 2-bit FNE codes, 4 a byte (``discretize --pack``)
            fs = store.create_features(kind, (3,), "uint8", attrs={"kind": "fne", "packed": True, "n_features": 10},
                                       block_rows=BLOCK)
            rows = rng.integers(0, 256, (N, 3)).astype(np.uint8)
        else:
            fs = store.create_features(kind, (3, 5), "float32", attrs={"kind": "regions"}, block_rows=BLOCK,
                                       extra={"count": ((), "int32")})
            rows = rng.standard_normal((N, 3, 5)).astype(np.float32)
            counts = rng.integers(1, 4, N).astype(np.int32)
        for b in fs.blocks():
            more = {"count": counts[b.start:b.stop]} if kind == "regions" else {}
            fs.write_block(b, rows[b.start:b.stop], **more)
    return kind


def _store(path) -> FeatureStore:
    with FeatureStore.building(path, dataset="t") as st:
        st.write_images([f"i{i}" for i in range(N)], [f"{i}.jpg" for i in range(N)],
                        ["train"] * (N - 8) + ["val"] * 4 + ["test"] * 4)
        st.write_captions([f"c{i}" for i in range(2 * N)], np.repeat(np.arange(N), 2))
    return FeatureStore.open(path, mode="r+")


def _tokens() -> Tokens:
    lengths = 1 + np.arange(2 * N) % 4
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return Tokens(np.arange(offsets[-1]) % 11 + 1, offsets, [str(i) for i in range(12)])


def _batches(source: FeatureSource, store: FeatureStore, how: str) -> list:
    """Every tensor the trainer's stream (or evaluation's reader) yields, in order."""
    rows = store.split_rows("train")
    stream = PairStream(source, _tokens(), rows, store.caption_images(), batch_size=6, captions="all",
                        window_chunks=None if how == "global" else 3, seed=5)
    out = []
    if how == "eval":
        return [t for f, c in image_batches(source, store.split_rows("train"), 7) for t in (f, c) if t is not None]
    for epoch in (0, 1):
        if how == "part":
            batches = [b for rank in (0, 1) for b in stream.epoch_part(epoch, rank, 2)]
        else:
            batches = list(stream.epoch(epoch))
        for b in batches:
            out += [t for t in (b.feats, b.counts, b.tokens, b.lengths, b.images) if t is not None]
    return out


@pytest.mark.parametrize("kind", ["global", "fne", "packed", "regions"])
def test_the_trainers_batches_from_s3_equal_those_from_disk_bit_for_bit(s3, tmp_path, kind):
    """The same set on disk and on S3: every batch of two epochs (one window holding the split, windows
    of 3 blocks, each rank's part of a data-parallel epoch) and evaluation's image batches are equal
    bit for bit; and the disk side equals the rows as written, decoded by numpy."""
    disk, remote = _store(tmp_path / "d.zarr"), _store(s3.url())
    _write(disk, kind)
    _write(remote, kind)
    src_d = FeatureSource(FeatureStore.open(tmp_path / "d.zarr").features(kind))
    src_s = FeatureSource(FeatureStore.open(s3.url()).features(kind))
    assert src_s.reader.remote and src_s.requests == 16 and not src_d.reader.remote
    for how in ("global", "windows", "part", "eval"):
        a, b = _batches(src_d, disk, how), _batches(src_s, remote, how)
        assert len(a) == len(b) > 0, how
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.numpy(), y.numpy()), how
    want = np.asarray(FeatureStore.open(tmp_path / "d.zarr").features(kind).data[:])
    if kind == "packed":   # unpacked here: 4 two-bit two's-complement codes a byte, low bits first
        codes = ((want[..., None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & 3).astype(np.int64)
        want = (codes - 4 * (codes >= 2)).reshape(N, -1)[:, :10]
    want = want.astype(np.float32)
    got, counts = src_s.read(0, N)
    assert np.array_equal(got, want)
    assert (counts is None) == (kind != "regions")
    got, _ = src_s.read(3, 9)                 # a span across block edges
    assert np.array_equal(got, want[3:9])


class Gate:
    """WSGI middleware in front of moto's app: counts the GETs of chunk objects under ``prefix`` that
    are in flight at once. Each such GET waits (up to ``hold`` s) until ``want`` of them were in flight
    together, so reads that overlap show it whatever the machine's speed, and sequential reads show
    a peak of 1."""

    def __init__(self, app, prefixes: tuple[str, ...], want: int, hold: float = 10.0):
        self.app, self.prefixes, self.want, self.hold = app, prefixes, want, hold
        self.cond = threading.Condition()
        self.reset()

    def reset(self):
        self.inflight = self.peak = self.gets = 0
        self.other = []

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "GET" or not environ.get("PATH_INFO", "").startswith(self.prefixes):
            self.other.append(f'{environ["REQUEST_METHOD"]} {environ.get("PATH_INFO")}')
            return self.app(environ, start_response)
        with self.cond:
            self.inflight += 1
            self.gets += 1
            self.peak = max(self.peak, self.inflight)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.peak >= self.want, timeout=self.hold)
        try:
            return list(self.app(environ, start_response))
        finally:
            with self.cond:
                self.inflight -= 1


@pytest.fixture()
def gated(s3):
    """A second HTTP server over the same in-process moto backend, with a :class:`Gate` in front."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    gate = Gate(DomainDispatcherApplication(create_backend_app),
                tuple(f"/{s3.bucket}/x.zarr/features/regions/{a}/c/" for a in ("data", "count")), want=4)
    server = make_server("127.0.0.1", 0, gate, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    gate.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    yield gate
    server.shutdown()
    thread.join()


def test_a_window_is_read_with_several_requests_in_flight_and_no_more_than_the_bound(s3, gated, tmp_path):
    """With ``read_requests=4``, the window reads (one process, the data-parallel ranks' part reads and
    evaluation's reads) have 4 chunk GETs in flight at once at the server, never more; each block is
    one GET per array (data, and count for regions), and no metadata is read per block. With
    ``read_requests=1`` the reads are one at a time."""
    _write(_store(s3.url()), "regions")
    store = FeatureStore.open(s3.url(), storage_options={"endpoint": gated.endpoint, "read_requests": "4"})
    src = FeatureSource(store.features("regions"))
    assert src.requests == 4
    stream = PairStream(src, _tokens(), store.split_rows("train"), store.caption_images(), batch_size=6,
                        captions="one", seed=1)
    assert stream.global_shuffle       # one window of the 8 blocks holding train rows
    for name, run in (("epoch", lambda: list(stream.epoch(0))),
                      ("part", lambda: list(stream.epoch_part(0, 1, 2))),
                      ("eval", lambda: list(image_batches(src, store.split_rows("train"), 5)))):
        gated.reset()
        run()
        assert gated.peak == 4, (name, gated.peak)
        assert gated.gets == 2 * 8, (name, gated.gets)     # data + count of each of the 8 blocks, once
        assert not [r for r in gated.other if "/features/regions/" in r], name   # no metadata read per block
    # read_requests=1: one GET at a time (the gate does not wait for company)
    store = FeatureStore.open(s3.url(), storage_options={"endpoint": gated.endpoint, "read_requests": "1"})
    src = FeatureSource(store.features("regions"))
    stream = PairStream(src, _tokens(), store.split_rows("train"), store.caption_images(), batch_size=6, seed=1)
    gated.reset()
    gated.want = 1
    list(stream.epoch(0))
    assert gated.peak == 1 and gated.gets == 2 * 8


def test_read_requests_must_be_a_positive_whole_number(s3):
    _write(_store(s3.url()), "global")
    for bad in ("0", "many"):
        store = FeatureStore.open(s3.url(), storage_options={"read_requests": bad})
        with pytest.raises(ValueError, match=f"read_requests must be a whole number of at least 1, got '{bad}'"):
            FeatureSource(store.features("global"))


def test_a_damaged_chunk_object_is_refused_before_its_rows_reach_a_batch(s3):
    """A chunk object changed after its commit: the stream stops with the block named, nothing of it used."""
    _write(_store(s3.url()), "global")
    key = "x.zarr/features/global/data/c/2/0"
    body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body[:-4] + b"\x00\x00\x80\x7f")
    store = FeatureStore.open(s3.url())
    src = FeatureSource(store.features("global"))
    stream = PairStream(src, _tokens(), store.split_rows("train"), store.caption_images(), batch_size=6)
    with pytest.raises(StoreError, match=r"block 2 \(rows 8-11\) is damaged \(data chunk file's CRC-32"):
        list(stream.epoch(0))
