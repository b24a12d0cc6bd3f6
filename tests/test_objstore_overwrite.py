"""``--overwrite`` on object storage (issue 35): a feature set and a whole store replaced on an ``s3://``
store (moto, the ``s3`` fixture) with the promises they have on disk (docs/store.md, "Replacing a set
or a store on object storage"): the old one whole and readable until the new one is complete, a failed
run leaves it as it was, a swap stopped at any step is finished by the next writer, a reader meanwhile
gets one clear error (never a mix, never fill values for deleted chunks), and nothing of the old one
is left behind.

A swap "stopped" here raises at one of its write points (``storage/faults.py`` names), in this process:
the objects are left as a ``kill -9`` there leaves them (the swap has no handler that writes). The
subprocess kills are in ``tests/test_objstore_slow.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.storage import integrity, objcommit, objstore  # noqa: E402
from vsekit.storage import objsets, store as store_mod  # noqa: E402
from vsekit.storage.base import StoreError  # noqa: E402
from vsekit.storage.store import FeatureStore, replace_mark  # noqa: E402

pytestmark = pytest.mark.e2e

OPTS = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
            crops=1, batch_size=2, block_rows=4, progress=False, workers=0)
NEW = {**OPTS, "resize": 80}      # other settings: another set
SWAP_STEPS = ["replace:unpublish", "replace:delete", "replace:copy", "replace:publish", "replace:cleanup"]
STORE_STEPS = ["ingest:replace:unpublish", "ingest:replace:delete", "ingest:replace:copy",
               "ingest:replace:publish", "ingest:replace:cleanup"]


def _set_point(monkeypatch, point) -> None:
    """Put ``point`` at the write points of sets (storage/store.py) and of their swaps (storage/objsets.py)."""
    for module in (store_mod, objsets):
        monkeypatch.setattr(module, "point", point)


class Stop(BaseException):
    """Raised at a write point: the run stops there as if killed."""


def _stop_at(monkeypatch, name: str, nth: int = 1) -> None:
    hits = {"n": 0}
    real = store_mod.point

    def point(at: str) -> None:
        if at == name:
            hits["n"] += 1
            if hits["n"] == nth:
                raise Stop(at)
        real(at)

    _set_point(monkeypatch, point)


def _run(args):
    return CliRunner().invoke(main, args)


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def _left_over(s3, name: str) -> list[str]:
    """Objects of a staged set, a swap mark or a lease still there."""
    return [k for k in s3.keys() if f".{name}.next-" in k or f".{name}.partial-" in k
            or "/.vsekit/swaps/" in k or "/.vsekit/leases/" in k]


def _small_store(url: str) -> FeatureStore:
    with FeatureStore.building(url, dataset="t") as st:
        st.write_images(["a", "b", "c", "d", "e"], [f"{i}.jpg" for i in "abcde"], ["train"] * 5)
        st.write_captions(["x"] * 5, [0, 1, 2, 3, 4])
    return FeatureStore.open(url, mode="r+")


def _write_set(st: FeatureStore, rows: np.ndarray, overwrite: bool = False, seed: int = 0):
    """Set ``f`` written with ``rows`` (``overwrite``: built beside the old one; returned uncommitted)."""
    fs = st.create_features("f", (3,), "float32", attrs={"kind": "global", "seed": seed}, block_rows=2,
                            overwrite=overwrite, beside=overwrite)
    for b in fs.blocks():
        fs.write_block(b, rows[b.start:b.stop])
    return fs


def test_extract_overwrite_on_s3_equals_a_fresh_extraction_on_disk_and_leaves_nothing_old(s3, demo_dir, tmp_path):
    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy

    disk, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    ref = extract(disk, **NEW)                     # a fresh extraction with the new settings, on disk
    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, s3.url())
    first = extract(s3.url(), **OPTS)
    old = FeatureStore.open(s3.url()).features(first.name)
    old_gen, old_data = old.attrs["generation"], old.data[:]
    with pytest.raises(StoreError, match="pass --overwrite to replace it"):
        extract(s3.url(), **NEW)
    res = extract(s3.url(), **NEW, overwrite=True)
    assert res.name == ref.name and res.done == disk.n_images
    fs = FeatureStore.open(s3.url()).features(res.name)
    want = disk.features(ref.name).data[:]
    assert np.array_equal(fs.data[:], want) and not np.array_equal(want, old_data)
    assert np.array_equal(fs.status[:], disk.features(ref.name).status[:])
    assert fs.attrs["resize"] == 80 and fs.attrs["generation"] != old_gen
    # one record per block, all of the new generation; no object or record of the old one, nothing staged
    assert sorted(objcommit.records(fs)) == [b.index for b in fs.blocks()]
    records = [k for k in s3.keys() if "/.vsekit/commits/" in k]
    assert records and all(f"/{fs.attrs['generation']}/" in k for k in records), records
    assert not [k for k in s3.keys() if old_gen in k] and not _left_over(s3, res.name)
    assert integrity.verify(fs).ok
    again = extract(s3.url(), **NEW)
    assert again.blocks_run == 0 and again.blocks_skipped == len(fs.blocks())


def test_a_failed_extract_overwrite_on_s3_leaves_the_old_set_whole_and_readable(s3, demo_dir, monkeypatch):
    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.train.data import FeatureSource

    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, s3.url())
    first = extract(s3.url(), **OPTS)
    before = {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()
              if "/.vsekit/" not in k or "/.vsekit/commits/" in k}
    old = FeatureStore.open(s3.url()).features(first.name)
    old_data = old.data[:]
    _stop_at(monkeypatch, "write_block:data", nth=2)    # the new set's second block fails
    with pytest.raises(Stop):
        extract(s3.url(), **NEW, overwrite=True)
    _set_point(monkeypatch, lambda at: None)
    after = {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()
             if "/.vsekit/" not in k or "/.vsekit/commits/" in k}
    assert after == before                       # every object of the old set as it was, nothing staged left
    fs = FeatureStore.open(s3.url()).features(first.name)
    src = FeatureSource(fs)
    out = np.zeros_like(old_data)
    for a, b in src.chunks():
        src.read_into(a, b, out[a:b])
    assert np.array_equal(out, old_data) and fs.attrs["generation"] == old.attrs["generation"]
    assert integrity.verify(fs).ok and not _left_over(s3, first.name)


@pytest.mark.parametrize("step", ["replace:mark", *SWAP_STEPS])
def test_a_swap_stopped_at_each_step_is_finished_by_the_next_writer_and_readers_get_one_clear_error(
        s3, monkeypatch, step):
    """Stopped before its mark the old set stays whole; stopped anywhere after it, a reader that opens
    the set is told it is being replaced, a trainer already reading the old set is refused (its reads
    are checked against the old records: never a mix, never zeros for deleted chunks), and the next
    writer of the set finishes the swap: the new set whole, nothing of the old one left."""
    from vsekit.train.data import FeatureSource

    rng = np.random.default_rng(0)
    old_rows, new_rows = rng.standard_normal((2, 5, 3)).astype(np.float32)
    st = _small_store(s3.url())
    with st.writer("f", stage="test"):
        old = _write_set(st, old_rows)
    old_gen = old.attrs["generation"]
    reading = FeatureSource(FeatureStore.open(s3.url()).features("f"))   # a trainer opened the old set
    reading.read(0, 2)
    _stop_at(monkeypatch, step)
    with pytest.raises(Stop), st.writer("f", stage="test"):
        new = _write_set(st, new_rows, overwrite=True, seed=1)
        new_gen = new.attrs["generation"]
        st.commit(new)
    _set_point(monkeypatch, lambda at: None)
    if step == "replace:mark":   # before the mark: the old set whole; the staged one is a leftover
        fs = FeatureStore.open(s3.url()).features("f")
        assert np.array_equal(fs.data[:], old_rows) and fs.attrs["generation"] == old_gen
        assert reading.read(2, 4)[0].tolist() == old_rows[2:4].tolist()
        with st.writer("f", stage="test"):   # the next writer of f deletes the leftover
            assert st.remove_leftovers("f") == [new.name]
        assert not _left_over(s3, "f")
        return
    with pytest.raises(StoreError, match=r"feature set 'f' .* is being replaced .* it finishes the swap first"):
        FeatureStore.open(s3.url()).features("f")
    r = _run(["info", s3.url(), "f"])
    assert r.exit_code == 1 and len(_errors(r.output)) == 1 and "is being replaced" in r.output, r.output
    r = _run(["info", s3.url()])                  # the store's summary names the set being replaced
    assert r.exit_code == 0 and "f: being replaced" in r.output, r.output
    if step in ("replace:unpublish", "replace:delete"):   # the old chunks are all still there
        assert np.array_equal(reading.read(0, 5)[0], old_rows)
    else:   # the old chunks are gone (or replaced): refused, never fill values or new rows under old records
        with pytest.raises(StoreError, match="was replaced"):
            reading.read(0, 5)
    # the next writer of f (here: one that takes its lease) finishes the swap first
    with FeatureStore.open(s3.url(), mode="r+").writer("f", stage="test"):
        pass
    fs = FeatureStore.open(s3.url()).features("f")
    assert np.array_equal(fs.data[:], new_rows) and fs.attrs["generation"] == new_gen
    assert sorted(objcommit.records(fs)) == [0, 1, 2] and integrity.verify(fs).ok
    assert not [k for k in s3.keys() if old_gen in k] and not _left_over(s3, "f")
    with pytest.raises(StoreError, match="was replaced"):
        reading.read(0, 2)


def test_standardize_and_fne_overwrite_on_s3_equal_disk(s3, demo_dir, tmp_path):
    """standardize --overwrite (other options) replaces the derived set on S3 as on disk; fne --overwrite
    of both stages too."""
    from vsekit.storage.store import FeatureStore

    fast = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--crops", "1", "--input-size", "48",
            "--resize", "56", "--batch-size", "4", "--block-rows", "8", "--workers", "0", "--no-progress"]
    stores = {"s3": s3.url(), "disk": str(tmp_path / "d.zarr")}
    for st in stores.values():
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        assert _run(["extract", "--store", st, *fast]).exit_code == 0
    for st in stores.values():
        r = _run(["standardize", "--store", st, "--features", "test_resnet_fne"])
        assert r.exit_code == 0, r.output
    old_gen = FeatureStore.open(stores["s3"]).features("test_resnet_fne.z").attrs["generation"]
    r = _run(["standardize", "--store", stores["s3"], "--features", "test_resnet_fne", "--split", "val"])
    assert r.exit_code == 1 and "pass --overwrite" in _errors(r.output)[0], r.output
    for st in stores.values():
        r = _run(["standardize", "--store", st, "--features", "test_resnet_fne", "--split", "val", "--overwrite"])
        assert r.exit_code == 0 and "wrote 3 of 3 blocks" in r.output, r.output
    a, b = FeatureStore.open(stores["s3"]), FeatureStore.open(stores["disk"])
    z = "test_resnet_fne.z"
    assert np.array_equal(a.features(z).array("mean")[:], b.features(z).array("mean")[:])
    val_gen = a.features("test_resnet_fne.z").attrs["generation"]
    for st in stores.values():   # fne: both stages, each set replaced (.z from train again, then other thresholds)
        r = _run(["fne", "--store", st, "--features", "test_resnet_fne", "--pack", "--overwrite"])
        assert r.exit_code == 0, r.output
        r = _run(["fne", "--store", st, "--features", "test_resnet_fne", "--thresholds", "-0.5", "0.5", "--overwrite"])
        assert r.exit_code == 0, r.output
    a, b = FeatureStore.open(stores["s3"]), FeatureStore.open(stores["disk"])
    for name, arrays in (("test_resnet_fne.z", ("data", "mean", "std", "count", "status")),
                         ("test_resnet_fne.z.fne", ("data", "status"))):
        for arr in arrays:
            assert np.array_equal(a.features(name).group[arr][:], b.features(name).group[arr][:]), (name, arr)
        for key in ("pack", "thresholds", "split", "config_hash"):
            assert a.features(name).attrs.get(key) == b.features(name).attrs.get(key), (name, key)
        r = _run(["info", stores["s3"], name, "--verify"])
        assert r.exit_code == 0 and "no damage found" in r.output, r.output
    assert a.features("test_resnet_fne.z.fne").attrs.get("thresholds") == [-0.5, 0.5]
    assert not [k for k in s3.keys() if val_gen in k]
    assert not [k for k in s3.keys() if old_gen in k]
    assert not [k for k in s3.keys() if ".next-" in k or "/.vsekit/swaps/" in k or "/.vsekit/leases/" in k]


# --- a whole store ---------------------------------------------------------------------------------
def _store_objects(s3) -> dict[str, bytes]:
    return {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()}


def test_ingest_overwrite_of_an_s3_store_refuses_sets_and_live_writers_and_gives_the_disk_store(
        s3, demo_dir, tmp_path):
    from test_objstore_ingest import _assert_same, _contents   # the same comparison as every ingest

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    karpathy = ["ingest", "karpathy", str(demo_dir / "dataset_demo.json")]
    for st in (url, disk):
        assert _run([*karpathy, "--store", st]).exit_code == 0
        st_ = FeatureStore.open(st, mode="r+")
        with st_.writer("f", stage="test"):
            _write_set(st_, np.ones((st_.n_images, 3), np.float32))
    r = _run([*karpathy, "--store", url])
    assert r.exit_code == 1 and "already exists" in _errors(r.output)[0], r.output
    before = _store_objects(s3)
    r = _run([*karpathy, "--store", url, "--overwrite"])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1 and "holds 1 feature set (f)" in errors[0], r.output
    assert "--drop-features" in errors[0] and _store_objects(s3) == before
    # refused while a writer holds a lease in the store
    lease = objstore.SetLease(objstore.Objects(url), "f", "vsekit extract").acquire()
    try:
        r = _run([*karpathy, "--store", url, "--overwrite", "--drop-features", "--restval-as-train"])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1 and "'f' in it is being written by vsekit extract" in errors[0]
    finally:
        lease.release()
    assert _store_objects(s3) == before
    for st in (url, disk):
        r = _run([*karpathy, "--store", st, "--overwrite", "--drop-features", "--restval-as-train"])
        assert r.exit_code == 0 and "--drop-features: dropped 1 feature set: f" in r.output, r.output
    _assert_same(_contents(url), _contents(disk))
    assert FeatureStore.open(url).feature_names() == []
    keys = s3.keys()
    assert not [k for k in keys if "/features/" in k or "/.vsekit/" in k], keys


def test_a_failed_ingest_overwrite_leaves_the_old_s3_store_whole(s3, demo_dir, monkeypatch):
    url = s3.url("stores/demo.zarr")
    karpathy = ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", url]
    assert _run(karpathy).exit_code == 0
    before = _store_objects(s3)
    _stop_at(monkeypatch, "ingest:complete")            # fails after the new store's arrays are written
    with pytest.raises(Stop):
        CliRunner().invoke(main, [*karpathy, "--overwrite", "--restval-as-train"], catch_exceptions=False)
    _set_point(monkeypatch, lambda at: None)
    assert _store_objects(s3) == before           # not one object changed; the new store's are gone
    assert FeatureStore.open(url).n_images == json.loads(before["stores/demo.zarr/images/id/zarr.json"])["shape"][0]


@pytest.mark.parametrize("step", ["ingest:replace:mark", *STORE_STEPS])
def test_an_ingest_overwrite_stopped_in_its_swap_is_named_on_opening_and_finished_by_the_next_one(
        s3, demo_dir, tmp_path, monkeypatch, step):
    from test_objstore_ingest import _assert_same, _contents

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    karpathy = ["ingest", "karpathy", str(demo_dir / "dataset_demo.json")]
    assert _run([*karpathy, "--store", url]).exit_code == 0
    assert _run([*karpathy, "--store", disk, "--restval-as-train"]).exit_code == 0
    old = _contents(url)
    _stop_at(monkeypatch, step)
    with pytest.raises(Stop):
        CliRunner().invoke(main, [*karpathy, "--store", url, "--overwrite", "--restval-as-train"],
                           catch_exceptions=False)
    _set_point(monkeypatch, lambda at: None)
    if step in ("ingest:replace:mark", "ingest:replace:unpublish"):   # nothing deleted yet: the old store whole
        _assert_same(_contents(url), old)
    if step == "ingest:replace:cleanup":   # the new store published whole: it opens (the next ingest cleans up)
        _assert_same(_contents(url), _contents(disk))
    if step != "ingest:replace:mark":
        for args in (["info", url], ["tokenize", "--store", url]):   # from the old zarr.json's deletion on
            if step in ("ingest:replace:unpublish", "ingest:replace:cleanup"):
                continue
            r = _run(args)
            errors = _errors(r.output)
            assert r.exit_code == 1 and len(errors) == 1, r.output
            assert "is being replaced by `vsekit ingest ... --overwrite`" in errors[0], r.output
        r = _run([*karpathy, "--store", url])          # not a new store there meanwhile
        assert r.exit_code == 1 and "is being replaced" in _errors(r.output)[0], r.output
    # the next ingest --overwrite finishes that swap first, then does its own
    assert _run([*karpathy, "--store", url, "--overwrite", "--restval-as-train"]).exit_code == 0
    _assert_same(_contents(url), _contents(disk))
    assert not [k for k in s3.keys() if "/.vsekit/" in k], s3.keys()


def test_replace_marks_name_what_they_swap(s3):
    """The feature set mark names the staged set and its generation (what the next writer finishes)."""
    st = _small_store(s3.url())
    rows = np.zeros((5, 3), np.float32)
    with st.writer("f", stage="test"):
        _write_set(st, rows)
    monkey = objsets.ObjectSets.finish_swap
    try:
        objsets.ObjectSets.finish_swap = lambda self, name: False
        with st.writer("f", stage="test"):
            new = _write_set(st, rows + 1, overwrite=True, seed=1)
            st.commit(new)
    finally:
        objsets.ObjectSets.finish_swap = monkey
    mark = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=f"x.zarr/{replace_mark('f')}")["Body"].read())
    assert mark["staging"] == new.name and mark["generation"] == new.attrs["generation"]
    assert new.name.startswith(".f.next-")


@pytest.mark.parametrize("step", ["replace:unpublish", "replace:delete", "replace:copy"])
def test_a_swapper_that_lost_its_lease_deletes_and_copies_nothing_more(s3, monkeypatch, step):
    """A run paused in its swap past its lease's expiry (another run took the set over) checks the lease
    before each destructive step and stops there: what it would have deleted or copied is untouched."""
    rng = np.random.default_rng(0)
    old_rows, new_rows = rng.standard_normal((2, 5, 3)).astype(np.float32)
    st = _small_store(s3.url())
    with st.writer("f", stage="test"):
        _write_set(st, old_rows)
    real = store_mod.point
    before: dict[str, bytes] = {}

    def objects() -> dict[str, bytes]:
        return {k: s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read() for k in s3.keys()}

    with st.writer("f", stage="test"):
        new = _write_set(st, new_rows, overwrite=True, seed=1)

        def point(at: str) -> None:   # the lease is lost right at this step: as if paused, then taken over
            if at == step:
                before.update(objects())
                st.leases["f"].lost = "taken over"
            real(at)

        _set_point(monkeypatch, point)
        with pytest.raises(objstore.LeaseLost):
            st.commit(new)
        _set_point(monkeypatch, real)
    after = objects()
    assert before, "the swap never reached the step"
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    # from the moment the lease was lost, only the lease object itself changed (released or renewed)
    assert all("/.vsekit/leases/" in k for k in changed), sorted(changed)
