"""Stores on object storage (issue 35), against a local S3 server (moto, the ``s3`` fixture): the
provider probe, the set lease, publishing a set, commit records, and extraction equal to disk.

Each test starts from a fresh bucket on one moto server of the session; they take a few seconds.
Multi-process cases (local:2, killed and paused drivers) are in tests/test_objstore_slow.py."""

from __future__ import annotations

import json
import time
import zlib

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from vsekit.storage import integrity, objcommit, objstore  # noqa: E402
from vsekit.storage.base import ProvenanceError, StoreError  # noqa: E402
from vsekit.storage.store import FeatureStore  # noqa: E402

pytestmark = pytest.mark.e2e

OPTS = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
            crops=1, batch_size=2, block_rows=4, progress=False, workers=0)


def _small_store(url: str) -> FeatureStore:
    with FeatureStore.building(url, dataset="t") as st:
        st.write_images(["a", "b", "c", "d", "e"], [f"{i}.jpg" for i in "abcde"], ["train"] * 5)
        st.write_captions(["x"] * 5, [0, 1, 2, 3, 4])
    return FeatureStore.open(url, mode="r+")


def overwriting(monkeypatch):
    """Make every create-if-absent overwrite, as S3-compatible services that ignore If-None-Match do."""
    def create(self, key, data):
        return self.put(key, data) or "etag"
    monkeypatch.setattr(objstore.Objects, "create", create)
    monkeypatch.setattr(objstore, "_PROBED", {})   # an earlier command's probe saw the honest server


def test_the_probe_passes_on_s3_and_fails_on_a_provider_that_overwrites(s3, monkeypatch):
    objects = objstore.Objects(s3.url())
    assert objstore.honours_conditions(objects) is True
    assert not [k for k in s3.keys() if "probe" in k]          # the probe object is removed again
    objstore.require_conditions(objects, "x")                  # no error
    monkeypatch.setattr(objstore, "_PROBED", {})
    overwriting(monkeypatch)
    assert objstore.honours_conditions(objstore.Objects(s3.url())) is False
    with pytest.raises(StoreError, match=r"without --cluster \(in one process\)"):
        objstore.require_conditions(objstore.Objects(s3.url()), "extract with more than one writer", multi=True)
    with pytest.raises(StoreError, match="say so with --storage-option single_writer=true"):
        objstore.require_conditions(objstore.Objects(s3.url()), "vsekit extract")   # in-process too
    objstore.require_conditions(objstore.Objects(s3.url(), {"single_writer": "true"}), "vsekit extract")
    with pytest.raises(StoreError, match="cannot keep two writers apart"):   # never for several processes
        objstore.require_conditions(objstore.Objects(s3.url(), {"single_writer": "true"}), "x", multi=True)


def test_create_and_swap_are_conditional_on_s3(s3):
    objects = objstore.Objects(s3.url())
    etag = objects.create("k", b"1")
    assert etag and objects.create("k", b"2") is None
    assert objects.get("k")[0] == b"1"
    new = objects.swap("k", b"3", etag)
    assert new and objects.swap("k", b"4", etag) is None      # a stale ETag: refused
    assert objects.get("k")[0] == b"3"


def test_a_second_lease_is_refused_and_an_expired_one_is_taken_over(s3):
    objects = objstore.Objects(s3.url())
    first = objstore.SetLease(objects, "f", "run A", ttl=30).acquire()
    with pytest.raises(objstore.LeaseHeld, match=r"'f' .* is being written by another run \(run A, pid"):
        objstore.SetLease(objects, "f", "run B", ttl=30).acquire()
    first.release()
    assert objects.get(objstore.lease_key("f")) is None
    second = objstore.SetLease(objects, "f", "run B", ttl=30).acquire()   # free again
    second.release()


def test_a_paused_holder_loses_its_lease_and_commits_nothing(s3):
    """A holder whose renewals stop (a paused process) past its expiry: another run takes the lease
    over, and the first one's next commit is refused; the block keeps the new holder's record."""
    st = _small_store(s3.url())
    ttl = 1.0
    a = objstore.SetLease(st.objects, "f", "A", ttl=ttl).acquire()
    st.leases["f"], st.lease_token = a, a.token
    fs = st.create_features("f", (3,), "float32", attrs={"kind": "global"}, block_rows=2)
    fs.write_block(0, np.ones((2, 3), np.float32))             # committed while A holds the lease
    a._stop.set()                                              # paused: no more renewals
    time.sleep(ttl + 0.3)
    other = FeatureStore.open(s3.url(), mode="r+")
    b = objstore.SetLease(other.objects, "f", "B", ttl=30).acquire()   # expired: taken over
    other.leases["f"], other.lease_token = b, b.token
    with pytest.raises(objstore.LeaseLost, match="lost the lease"):
        fs.write_block(1, np.full((2, 3), 7, np.float32))      # A wakes up: refused before its record
    assert objcommit.read_record(fs, 1) is None and fs.counts()["done"] == 2
    ofs = other.features("f")
    ofs.write_block(1, np.full((2, 3), 2, np.float32))
    recs = objcommit.records(ofs)
    assert recs[0]["token"] == a.token and recs[1]["token"] == b.token
    b.release()


def test_each_block_has_one_record_and_a_second_commit_is_refused(s3):
    st = _small_store(s3.url())
    with st.writer("f", stage="test"):
        fs = st.create_features("f", (3,), "float32", attrs={"kind": "global"}, block_rows=2)
        data = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert fs.write_block(0, data) is True
        fs.status[0:2] = 0                                    # as if killed between record and status
        assert fs.write_block(0, data + 1) is False           # a second writer of block 0 is told so
        assert fs.counts()["done"] == 0                       # it left the block alone: no status
        again = st.create_features("f", (3,), "float32", attrs={"kind": "global"}, block_rows=2)
        assert again.counts()["done"] == 2                    # the status restored from the record
    keys = [k for k in s3.keys() if "/.vsekit/commits/" in k]
    assert len(keys) == 1
    rec = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read())
    chunk = s3.client.get_object(Bucket=s3.bucket, Key="x.zarr/features/f/data/c/0/0")["Body"].read()
    assert rec["sums"]["data"] == [zlib.crc32(chunk), len(chunk)] and rec["status"] == [1, 1]
    assert np.array_equal(np.frombuffer(chunk, "<f4").reshape(2, 3), data)   # the first writer's bits
    # damage to a committed chunk is found against its record, and --repair drops the record
    s3.client.put_object(Bucket=s3.bucket, Key="x.zarr/features/f/data/c/0/0", Body=chunk[:-4] + b"\0\0\0\0")
    fs = FeatureStore.open(s3.url(), mode="r+").features("f")
    report = integrity.verify(fs)
    assert list(report.damaged) == [0] and "CRC-32" in report.damaged[0]
    assert integrity.verify(fs, quick=True).ok                 # same size: only the full check sees it
    integrity.repair(fs, report)
    assert fs.counts()["pending"] == 5 and objcommit.records(fs) == {}
    # issue 44 item 4: no record is ever deleted; the repair voided it in place, keeping what it said
    assert [k for k in s3.keys() if "/.vsekit/commits/" in k] == keys
    void = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read())
    assert void["void"] is True and void["record"] == rec and "CRC-32" in void["reason"]
    with st.writer("f", stage="test"):   # the rerun's commit replaces the void record: one record again
        again = st.features("f")
        assert again.write_block(0, data) is True and objcommit.read_record(again, 0)["status"] == [1, 1]
    assert [k for k in s3.keys() if "/.vsekit/commits/" in k] == keys
    # a record written after the check (another writer's) is never voided by a repair of the old view
    s3.client.put_object(Bucket=s3.bucket, Key="x.zarr/features/f/data/c/0/0", Body=chunk[:-4] + b"\0\0\0\0")
    stale = integrity.verify(fs)
    assert list(stale.damaged) == [0]
    other = dict(json.loads(s3.client.get_object(Bucket=s3.bucket, Key=keys[0])["Body"].read()), token="other")
    s3.client.put_object(Bucket=s3.bucket, Key=keys[0], Body=json.dumps(other).encode())   # written since
    assert integrity.repair(fs, stale) == 0 and objcommit.read_record(fs, 0) is not None
    assert fs.counts()["done"] == 2


def test_a_set_is_invisible_until_published_and_a_changed_setting_is_refused(s3, monkeypatch):
    import zarr

    st = _small_store(s3.url())
    seen = {}
    real_create = objstore.Objects.create

    def create(self, key, data):   # look at the store just before the publishing write
        if key.endswith("features/f/zarr.json"):
            seen["arrays"] = [k for k in s3.keys("x.zarr/features/f/") if k.endswith("zarr.json")]
            seen["sets"] = FeatureStore.open(s3.url()).feature_names()
        return real_create(self, key, data)
    monkeypatch.setattr(objstore.Objects, "create", create)
    with st.writer("f", stage="test"):
        st.create_features("f", (3,), "float32", attrs={"kind": "global", "crops": 1}, block_rows=2)
        assert seen["sets"] == [] and "x.zarr/features/f/data/zarr.json" in seen["arrays"]
        with pytest.raises(ProvenanceError, match="crops 1 → 10"):
            st.create_features("f", (3,), "float32", attrs={"kind": "global", "crops": 10}, block_rows=2)
    assert FeatureStore.open(s3.url()).feature_names() == ["f"]
    # plain zarr over zarr's own ObjectStore reads it, without vsekit
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    raw = S3Store(s3.bucket, prefix="x.zarr", endpoint=s3.endpoint, region="us-east-1", client_options={"allow_http": True})
    group = zarr.open_group(ObjectStore(raw, read_only=True), mode="r")
    assert group["features/f"].attrs["crops"] == 1 and group["images/id"][:].tolist() == list("abcde")


def test_extraction_on_s3_equals_one_on_disk_bit_for_bit(s3, demo_dir, tmp_path):
    import dask.array as da
    import zarr

    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy

    disk, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    ref = extract(disk, **OPTS)
    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, s3.url())
    res = extract(s3.url(), **OPTS)
    assert res.done == disk.n_images and res.blocks_run == len(disk.features(ref.name).blocks())
    fs = FeatureStore.open(s3.url()).features(res.name)
    want = disk.features(ref.name).data[:]
    assert np.array_equal(fs.data[:], want)
    # one commit record per block, and a rerun finds every block done
    assert sorted(objcommit.records(fs)) == [b.index for b in fs.blocks()]
    again = extract(s3.url(), **OPTS)
    assert again.blocks_run == 0 and again.blocks_skipped == len(fs.blocks())
    assert integrity.verify(fs).ok
    # dask reads the same array through zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    raw = S3Store(s3.bucket, prefix="x.zarr", endpoint=s3.endpoint, region="us-east-1", client_options={"allow_http": True})
    arr = zarr.open_group(ObjectStore(raw, read_only=True), mode="r")[f"features/{res.name}/data"]
    assert np.array_equal(da.from_zarr(arr).compute(), want)
    # and without vsekit or obstore: plain zarr and dask on the URL, through fsspec (s3fs), as on disk
    pytest.importorskip("s3fs")
    opts = {"endpoint_url": s3.endpoint, "key": "vsekit-test-key", "secret": s3.env["AWS_SECRET_ACCESS_KEY"]}
    root = zarr.open_group(s3.url(), mode="r", storage_options=opts)
    assert root.attrs["vsekit_format"] == disk.root.attrs["vsekit_format"]
    assert np.array_equal(root[f"features/{res.name}/data"][:], want)
    assert np.array_equal(np.asarray(root["images/id"][:]), np.asarray(disk.root["images/id"][:]))
    got = da.from_zarr(s3.url(), component=f"features/{res.name}/data", storage_options=opts)
    assert np.array_equal(got.compute(), want)


def test_a_store_made_by_a_killed_ingest_is_refused_with_how_out(s3):
    from vsekit.storage.objcommit import group_meta

    objects = objstore.Objects(s3.url())
    objects.create("zarr.json", group_meta({"vsekit_format": 1, "complete": False}))
    with pytest.raises(StoreError, match="its ingest has not finished"):
        FeatureStore.open(s3.url())
    with pytest.raises(StoreError, match="already exists"):
        _small_store(s3.url())


def test_the_trainers_feature_reads_check_each_block_against_its_commit_record(s3):
    """The trainer's loader (train/data.py FeatureSource over storage/chunks.py) reads a set on S3
    one GET per block, each block checked against its commit record: the rows come back as written, and a
    damaged chunk object is refused naming its block before its rows are used."""
    from vsekit.train.data import FeatureSource

    st = _small_store(s3.url())
    rows = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    with st.writer("f", stage="test"):
        fs = st.create_features("f", (3,), "float32", attrs={"kind": "global"}, block_rows=2)
        for b in fs.blocks():
            fs.write_block(b, rows[b.start:b.stop])
    src = FeatureSource(FeatureStore.open(s3.url()).features("f"))
    out = np.zeros((5, 3), np.float32)
    for a, b in src.chunks():
        src.read_into(a, b, out[a:b])
    assert np.array_equal(out, rows)
    key = "x.zarr/features/f/data/c/1/0"
    body = s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body[:4] + b"\xff\xff\xff\xff" + body[8:])
    src = FeatureSource(FeatureStore.open(s3.url()).features("f"))
    src.read(0, 2)                                             # block 0 is whole
    with pytest.raises(StoreError, match=r"block 1 \(rows 2-3\) is damaged \(data chunk file's CRC-32"):
        src.read(2, 4)


def test_a_memory_store_serves_one_process_and_refuses_a_cluster(demo_dir, tmp_path):
    """memory:// (tests, dry runs) keeps its objects in this process: extraction works there and equals
    disk; worker processes could not reach it, so --cluster is refused before any work."""
    import uuid

    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy

    url = f"memory://t{uuid.uuid4().hex[:8]}/x.zarr"
    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, url)
    with pytest.raises(StoreError, match="lives in this process only"):
        extract(url, cluster="local:2", **OPTS)
    assert FeatureStore.open(url).feature_names() == []
    res = extract(url, **OPTS)
    disk, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    ref = extract(disk, **OPTS)
    assert np.array_equal(FeatureStore.open(url).features(res.name).data[:], disk.features(ref.name).data[:])


def test_without_obstore_a_url_is_one_error_naming_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_obstore(name, *args, **kw):
        if name.startswith("obstore"):
            raise ImportError(name)
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_obstore)
    with pytest.raises(StoreError, match=r"need the obstore package: pip install 'vsekit\[s3\]'"):
        FeatureStore.open("s3://bucket/x.zarr")


def test_lock_files_refuse_a_url_and_make_no_local_folder(s3, tmp_path, monkeypatch):
    """A library call that reaches a lock file with a URL (a lock file cannot live on object storage)
    refuses it in one StoreError naming what serves URLs, and no folder named ``s3:`` appears; the
    stages that write a store on object storage take leases instead (:meth:`FeatureStore.writer`)."""
    from vsekit.storage import lock

    monkeypatch.chdir(tmp_path)
    url = s3.url()
    with pytest.raises(StoreError, match="does not serve stores on object storage yet; they are served by every"):
        with lock.writer_lock(url, "g", stage="vsekit test"):
            pass
    with pytest.raises(StoreError, match="does not serve stores on object storage yet"):
        lock.acquire(url, "g", "vsekit test")
    assert list(tmp_path.iterdir()) == [] and s3.keys() == []


def test_a_run_records_its_store_without_credentials_and_a_path_absolute(tmp_path, monkeypatch):
    """What `vsekit train` writes into config.json's "store" (and `evaluate` compares runs by)."""
    from vsekit.storage.objstore import store_ref

    assert store_ref("s3://AKIA:very-secret@bucket/stores/x.zarr/") == "s3://bucket/stores/x.zarr"
    assert store_ref("s3://bucket/x.zarr") == "s3://bucket/x.zarr"
    monkeypatch.chdir(tmp_path)
    assert store_ref("d.zarr") == str(tmp_path.resolve() / "d.zarr")
