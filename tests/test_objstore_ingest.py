"""Every ingest source and `vsekit split` on an ``s3://`` store (issue 35), against the same command
on a disk store: the same arrays and attributes, each feature set's blocks committed with one record
each (``info --verify``), nothing left behind by a failure, and sets added to an existing store
invisible until they are whole (docs/store.md, "Stores on object storage")."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402

pytestmark = pytest.mark.e2e

IGNORED_SET_ATTRS = ("generation", "parent_generation")     # a fresh id each time a set is made


def _run(args):
    return CliRunner().invoke(main, args)


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


def _contents(where) -> dict:
    """Every array and attribute a reader sees in the store (by plain zarr, group by group), but the
    disk store's ``blocksums`` (object storage keeps commit records instead)."""
    from vsekit.storage.store import FeatureStore

    store = FeatureStore.open(where)
    out = {"/": dict(store.root.attrs)}
    groups = [g for g in ("images", "captions", "tokens") if g in store.root]
    groups += [f"features/{n}" for n in store.feature_names()]
    for g in groups:
        group = store.root[g]
        attrs = dict(group.attrs)
        if g.startswith("features/"):
            attrs = {k: v for k, v in attrs.items() if k not in IGNORED_SET_ATTRS}
        out[g] = attrs
        for name in sorted(group.array_keys()):
            if name == "blocksums":
                continue
            arr = group[name]
            values = arr[:]
            out[f"{g}/{name}"] = (str(arr.dtype), arr.shape, arr.chunks,
                                  values.tolist() if values.dtype == object or values.dtype.kind in "UT" else values)
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], tuple):
            assert a[key][:3] == b[key][:3], key
            if isinstance(a[key][3], np.ndarray):
                assert a[key][3].dtype == b[key][3].dtype and np.array_equal(a[key][3], b[key][3]), key
            else:
                assert a[key][3] == b[key][3], key
        else:
            assert a[key] == b[key], key


def _clean_after(s3) -> None:
    """No lease left, no hidden set being built, no object outside the store's own layout."""
    keys = s3.keys()
    assert not [k for k in keys if "/.vsekit/leases/" in k], keys
    assert not [k for k in keys if ".partial-" in k], keys


def _verified(url: str) -> None:
    from vsekit.storage import objcommit
    from vsekit.storage.store import FeatureStore

    store = FeatureStore.open(url)
    for name in store.feature_names():
        fs = store.features(name)
        assert sorted(objcommit.records(fs)) == [b.index for b in fs.blocks()], name
        r = _run(["info", url, name, "--verify"])
        assert r.exit_code == 0 and "no damage found" in r.output, r.output


# --- inputs of each source ------------------------------------------------------------------------
def _jpeg(rng, side=16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def _butd_tsv(path, ids, counts, c=8, seed=0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for image_id, n in zip(ids, counts):
            xy = rng.uniform(0, 30, (n, 2))
            boxes = np.concatenate([xy, xy + rng.uniform(1, 30, (n, 2))], axis=1)   # x1 y1 x2 y2 pixels
            f.write(f"{image_id}\t64\t64\t{n}\t{_b64(boxes)}\t{_b64(rng.normal(size=(n, c)))}\n")


def _precomp(folder, ids_by_prefix, d=6, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, ids in ids_by_prefix.items():
        np.save(folder / f"{prefix}_ims.npy", rng.normal(size=(len(ids), d)).astype(np.float32))
        (folder / f"{prefix}_caps.txt").write_text("".join(f"{prefix} {i} caption {j}\n" for i in ids for j in range(5)))
        (folder / f"{prefix}_ids.txt").write_text("".join(f"{i}\n" for i in ids))


def _source(kind: str, demo_dir, tmp_path) -> list[str]:
    """The arguments of `vsekit ingest KIND ...` (without --store) for a small input of that kind."""
    if kind == "coco":
        data = json.loads((demo_dir / "dataset_demo.json").read_text())["images"][:10]
        ann = {"images": [{"id": im["cocoid"], "file_name": im["filename"]} for im in data],
               "annotations": [{"id": 10 * im["cocoid"] + j, "image_id": im["cocoid"], "caption": s["raw"]}
                               for im in data for j, s in enumerate(im["sentences"][:2])]}
        (tmp_path / "captions.json").write_text(json.dumps(ann))
        (tmp_path / "splits.json").write_text(json.dumps({str(im["cocoid"]): im["split"] for im in data}))
        return ["coco", str(tmp_path / "captions.json"), "--split-file", str(tmp_path / "splits.json"),
                "--image-root", str(demo_dir / "images")]
    if kind == "precomp":
        _precomp(tmp_path / "p", {"train": ["a", "b", "c", "d"], "dev": ["e", "f"], "test": ["g", "h", "i"]})
        return ["precomp", str(tmp_path / "p")]
    if kind == "butd":
        _butd_tsv(tmp_path / "f.tsv", ["1", "2", "3", "4"], [10, 36, 7, 20])
        (tmp_path / "splits.tsv").write_text("1\ttrain\n2\ttrain\n3\tval\n4\ttest\n")
        return ["butd", str(tmp_path / "f.tsv"), "--split-file", str(tmp_path / "splits.tsv")]
    if kind == "webdataset":
        from test_formats_webdataset import write_shards

        write_shards(tmp_path / "wds", n_shards=2, per_shard=4)
        return ["webdataset", str(tmp_path / "wds" / "shard-{0000..0001}.tar"), "--ratios", "0.5,0.25,0.25"]
    if kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        rng = np.random.default_rng(0)
        table = pa.table({"caption": [f"caption {i}" for i in range(8)], "key": [f"{i:09d}" for i in range(8)],
                          "jpg": pa.array([_jpeg(rng) for _ in range(8)], type=pa.binary())})
        pq.write_table(table, tmp_path / "00000.parquet", row_group_size=3)
        return ["parquet", str(tmp_path / "00000.parquet"), "--ratios", "0.5,0.25,0.25", "--seed", "3"]
    if kind == "hdf5":   # a vsekit export of a disk store with a feature set and tokens
        _precomp(tmp_path / "p", {"train": ["a", "b", "c"], "test": ["d", "e"]})
        src = str(tmp_path / "src.zarr")
        assert _run(["ingest", "precomp", str(tmp_path / "p"), "--store", src]).exit_code == 0
        assert _run(["tokenize", "--store", src, "--min-count", "1"]).exit_code == 0
        r = _run(["export", "hdf5", "--store", src, "--features", "precomp", "--out", str(tmp_path / "x.h5")])
        assert r.exit_code == 0, r.output
        return ["hdf5", str(tmp_path / "x.h5")]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["coco", "precomp", "butd", "webdataset", "parquet", "hdf5"])
def test_every_ingest_source_on_s3_gives_the_store_it_gives_on_disk(s3, demo_dir, tmp_path, kind):
    args = _source(kind, demo_dir, tmp_path)
    url, disk = s3.url("stores/new.zarr"), str(tmp_path / "d.zarr")
    r = _run(["ingest", *args, "--store", url])
    assert r.exit_code == 0, r.output
    assert _run(["ingest", *args, "--store", disk]).exit_code == 0
    _assert_same(_contents(url), _contents(disk))
    _verified(url)
    _clean_after(s3)
    if kind in ("precomp", "butd"):   # now an existing store: the set is there already
        r = _run(["ingest", *args, "--store", url])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1 and "already exists" in errors[0] and url in errors[0], r.output
    else:                              # one ingest per URL
        r = _run(["ingest", *args, "--store", url])
        assert r.exit_code == 1 and len(_errors(r.output)) == 1 and "already exists" in r.output, r.output


def _npz_folder(folder, ids, c=8, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i, image_id in enumerate(ids):
        n = 3 + i % 5
        np.savez(folder / f"{image_id}.npz", x=rng.normal(size=(n, c)).astype(np.float32),
                 bbox=rng.uniform(0, 60, (n, 4)).astype(np.float32), num_bbox=n, image_h=64, image_w=64)


def test_sets_added_to_an_s3_store_equal_disk_and_appear_only_whole(s3, demo_dir, tmp_path):
    """precomp, butd and npz into an existing store: built under a hidden name, published whole by one
    create-if-absent; a failure part-way leaves no set, no hidden objects and no lease."""
    from vsekit.storage.store import FeatureStore

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    for st in (url, disk):
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
    ids = FeatureStore.open(disk).image_ids().tolist()
    _precomp(tmp_path / "p", {"train": ids[:10], "test": ids[10:16]})
    _butd_tsv(tmp_path / "f.tsv", ids[:12], [5 + i for i in range(12)])
    _npz_folder(tmp_path / "npz", ids[4:20])
    commands = [["precomp", str(tmp_path / "p")], ["butd", str(tmp_path / "f.tsv")],
                ["npz", str(tmp_path / "npz"), "--dtype", "float32", "--name", "npz"]]
    for cmd in commands:
        for st in (url, disk):
            r = _run(["ingest", *cmd, "--store", st])
            assert r.exit_code == 0, (cmd, r.output)
    assert FeatureStore.open(url).feature_names() == ["npz", "precomp", "regions"]
    _assert_same(_contents(url), _contents(disk))
    _verified(url)
    _clean_after(s3)
    for where, st in (("s3", url), ("disk", disk)):   # report-boxes reads the set from S3 too
        r = _run(["report-boxes", st, "regions", "--rows", "0,3", "--out", str(tmp_path / f"boxes-{where}")])
        assert r.exit_code == 0, r.output
    for png in ("regions_0.png", "regions_3.png"):
        assert (tmp_path / "boxes-s3" / png).read_bytes() == (tmp_path / "boxes-disk" / png).read_bytes()
    # a failure in the middle (a non-finite feature): no set, nothing hidden, no lease; the store is as it was
    before = s3.keys()
    bad = np.load(tmp_path / "p" / "test_ims.npy")
    bad[3, 2] = np.nan
    np.save(tmp_path / "p" / "test_ims.npy", bad)
    r = _run(["ingest", "precomp", str(tmp_path / "p"), "--store", url, "--name", "broken"])
    errors = _errors(r.output)
    assert r.exit_code == 1 and len(errors) == 1 and "non-finite" in errors[0], r.output
    assert s3.keys() == before
    assert "broken" not in FeatureStore.open(url).feature_names()
    # --overwrite replaces a set as on disk: the new set whole, nothing of the old one left behind
    old_gen = FeatureStore.open(url).features("npz").attrs["generation"]
    r = _run(["ingest", "npz", str(tmp_path / "npz"), "--store", url, "--name", "npz"])
    assert r.exit_code == 1 and "pass --overwrite to replace it" in _errors(r.output)[0], r.output
    _npz_folder(tmp_path / "npz2", ids[0:12], seed=1)
    for st in (url, disk):
        r = _run(["ingest", "npz", str(tmp_path / "npz2"), "--store", st, "--name", "npz", "--dtype", "float32",
                  "--overwrite"])
        assert r.exit_code == 0, r.output
    _assert_same(_contents(url), _contents(disk))
    _verified(url)
    _clean_after(s3)
    assert FeatureStore.open(url).features("npz").attrs["generation"] != old_gen
    assert not [k for k in s3.keys() if old_gen in k or ".npz.next-" in k or "/.vsekit/swaps/" in k]


@pytest.mark.slow   # kills a process at a write point and reruns it
def test_a_killed_set_ingest_on_s3_leaves_no_set_and_a_rerun_completes(s3, demo_dir, tmp_path):
    """An ingest killed (``kill -9``) after its hidden set is written and copied under its name, just
    before it is published: no reader lists a set (opening it names the swap); the rerun finishes that
    swap, then builds and publishes the same set as on disk, and leaves nothing of the killed run's."""
    from vsekit.storage.base import StoreError
    from vsekit.storage.store import FeatureStore

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    for st in (url, disk):
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
    ids = FeatureStore.open(disk).image_ids().tolist()
    _npz_folder(tmp_path / "npz", ids)
    argv = [sys.executable, "-c", "from vsekit.cli import main; main()", "ingest", "npz", str(tmp_path / "npz"), "--store", url]
    # after its blocks are committed and its objects copied under the set's name, before it is published
    env = {**os.environ, **s3.env, "VSEKIT_FAULT": "replace:publish"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 137, proc.stderr
    assert any(".regions.partial-" in k for k in s3.keys())        # the hidden set it was building
    assert FeatureStore.open(url).feature_names() == []            # which no reader lists
    with pytest.raises(StoreError, match="feature set 'regions' .* is being replaced"):
        FeatureStore.open(url).features("regions")
    # what the killed run had copied under the set's own name, unpublished, is not kept either
    stray = s3.url("stores/demo.zarr").split("/", 3)[3] + "/features/regions/stray/zarr.json"
    array_meta = next(k for k in s3.keys() if k.endswith("/features/regions/count/zarr.json"))
    s3.client.copy_object(Bucket=s3.bucket, Key=stray, CopySource={"Bucket": s3.bucket, "Key": array_meta})
    env.pop("VSEKIT_FAULT")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _run(["ingest", "npz", str(tmp_path / "npz"), "--store", disk]).exit_code == 0
    _assert_same(_contents(url), _contents(disk))
    _verified(url)
    _clean_after(s3)


FAST = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--crops", "1", "--input-size", "48",
        "--resize", "56", "--batch-size", "4", "--block-rows", "8", "--workers", "0", "--no-progress"]


def test_split_of_an_s3_store_without_sets_equals_disk_and_waits_for_no_writer(s3, demo_dir, tmp_path):
    """The fast case of the test below: the same split array and history as on disk; refused while a
    writer's lease is live."""
    from vsekit.storage import objstore
    from vsekit.storage.store import FeatureStore

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    for st in (url, disk):
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        r = _run(["split", "--store", st, "--ratios", "0.5,0.25,0.25", "--seed", "4"])
        assert r.exit_code == 0, r.output
    a, b = _contents(url), _contents(disk)
    for got in (a, b):
        assert len(got["/"].pop("split_generation")) == 32
        for rec in got["/"]["split_history"]:
            rec.pop("at")
    _assert_same(a, b)
    assert np.bincount(FeatureStore.open(url).image_splits(), minlength=3)[:3].tolist() == [12, 6, 6]
    lease = objstore.SetLease(FeatureStore.open(url).objects, "tokens", "vsekit tokenize", ttl=60).acquire()
    try:
        r = _run(["split", "--store", url, "--val", "3", "--test", "3"])
        assert r.exit_code == 1 and "is being written by vsekit tokenize" in r.output, r.output
    finally:
        lease.release()
    _clean_after(s3)


@pytest.mark.slow   # extracts and standardizes on two stores (over 5 s)
def test_split_on_s3_gives_the_split_it_gives_on_disk_and_excludes_writers(s3, demo_dir, tmp_path):
    """`vsekit split` on S3: the same split array, history and stale marks as on disk, the feature sets
    kept; refused while a set's lease is live, and a writer is refused while the split holds the store."""
    from vsekit.storage import objstore
    from vsekit.storage.store import FeatureStore

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    outputs = {}
    for st in (url, disk):
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        assert _run(["extract", "--store", st, *FAST]).exit_code == 0
        assert _run(["standardize", "--store", st, "--features", "test_resnet_fne"]).exit_code == 0
        before = FeatureStore.open(st).image_splits().copy()
        r = _run(["split", "--store", st, "--val", "5", "--test", "4", "--seed", "2"])
        assert r.exit_code == 0, r.output
        outputs[st] = r.output.replace(st, "STORE")
    assert outputs[url] == outputs[disk]
    a, b = _contents(url), _contents(disk)
    for got in (a, b):   # the re-split's time and id differ between the two runs
        assert len(got["/"].pop("split_generation")) == 32
        for rec in got["/"]["split_history"]:
            rec.pop("at")
    _assert_same(a, b)
    after = FeatureStore.open(url).image_splits()
    assert np.bincount(after, minlength=3)[1:3].tolist() == [5, 4] and not np.array_equal(after, before)
    assert "before `vsekit split` changed that split's images" in str(a["features/test_resnet_fne.z"])
    _verified(url)
    _clean_after(s3)
    # a live writer's lease: the split is refused and changes nothing
    store = FeatureStore.open(url, mode="r+")
    lease = objstore.SetLease(store.objects, "test_resnet_fne", "vsekit extract", ttl=60).acquire()
    try:
        r = _run(["split", "--store", url, "--val", "3", "--test", "3"])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1 and "is being written by vsekit extract" in errors[0], r.output
        assert np.array_equal(FeatureStore.open(url).image_splits(), after)
    finally:
        lease.release()
    # the split's lease held: a writer is refused before it writes anything
    with store.store_writer("vsekit split"):
        r = _run(["extract", "--store", url, *FAST, "--name", "other"])
        errors = _errors(r.output)
        assert r.exit_code == 1 and len(errors) == 1 and "is being re-split" in errors[0], r.output
    assert "other" not in FeatureStore.open(url).feature_names()
    _clean_after(s3)


def test_report_reads_an_s3_store_as_it_reads_the_same_store_on_disk(s3, demo_dir, tmp_path):
    """`vsekit report` of one run, reading its examples from the S3 store or from the same store on
    disk (made by the same commands): the same report.json and page, but for the store's name."""
    stores = {"s3": s3.url("stores/demo.zarr"), "disk": str(tmp_path / "d.zarr")}
    for st in stores.values():
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        assert _run(["extract", "--store", st, *FAST]).exit_code == 0
        assert _run(["tokenize", "--store", st, "--min-count", "1"]).exit_code == 0
    run = tmp_path / "run"
    r = _run(["train", "--store", stores["s3"], "--out", str(run), "--features", "test_resnet_fne", "--model", "vse",
              "--preset", "demo", "--embed-dim", "16", "--word-dim", "8", "--batch-size", "8", "--epochs", "1",
              "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    pages = {}
    for where, st in stores.items():
        out = tmp_path / f"report-{where}"
        r = _run(["report", str(run), "--out", str(out), "--store", st, "--device", "cpu", "--attention", "0"])
        assert r.exit_code == 0, r.output
        pages[where] = ((out / "report.json").read_text().replace(st, "STORE"),
                        (out / "index.html").read_text().replace(st, "STORE"))
    examples = json.loads(pages["s3"][0])["runs"][0]["examples"]     # scored from the store's features
    assert examples["source"] == "the run's model (best checkpoint)" and len(examples["captions"]) == 8
    assert pages["s3"] == pages["disk"]
    # without --store: the URL the run recorded
    r = _run(["report", str(run), "--out", str(tmp_path / "report-own"), "--device", "cpu", "--attention", "0"])
    assert r.exit_code == 0 and "8 caption and 3 image examples" in r.output, r.output
    assert (tmp_path / "report-own" / "report.json").read_text() == (tmp_path / "report-s3" / "report.json").read_text()


def _tokens(where) -> tuple:
    from vsekit.storage.store import FeatureStore

    store = FeatureStore.open(where)
    attrs = dict(store.root["tokens"].attrs)
    return (store.root["tokens/ids"][:].tolist(), store.root["tokens/offsets"][:].tolist(),
            {k: v for k, v in attrs.items() if k != "pipeline"})


def test_tokenize_again_on_s3_replaces_the_tokens_as_on_disk(s3, demo_dir, tmp_path):
    """A second tokenize on S3 replaces the tokens, as on disk: the same tokens and vocabulary; a run
    that fails keeps the old tokens."""
    from vsekit.tokenize.runner import SWAP_MARK

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    for st in (url, disk):
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
        for min_count in ("1", "3"):
            r = _run(["tokenize", "--store", st, "--min-count", min_count])
            assert r.exit_code == 0 and "tokenized 120 captions" in r.output, r.output
    assert _tokens(url) == _tokens(disk) and _tokens(url)[2]["min_count"] == 3
    _clean_after(s3)
    assert not [k for k in s3.keys() if "tokens_partial" in k or SWAP_MARK in k]
    # a failure (no caption in the vocabulary splits) keeps the old tokens
    kept = _tokens(url)
    r = _run(["tokenize", "--store", url, "--vocab-splits", "restval"])
    assert r.exit_code == 1 and len(_errors(r.output)) == 1 and "no captions in the vocabulary splits" in r.output
    assert _tokens(url) == kept


@pytest.mark.slow   # kills processes at write points and reruns
def test_a_tokenize_killed_in_its_swap_on_s3_leaves_old_or_no_tokens_and_the_next_one_finishes_it(
        s3, demo_dir, tmp_path):
    """Killed (``kill -9``) before its swap mark: the old tokens stay; killed in the swap: no tokens at
    all (never a mix of two tokenizations), and the next tokenize finishes that swap, then does its own."""
    from vsekit.storage.store import FeatureStore
    from vsekit.tokenize.runner import SWAP_MARK

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    for st in (url, disk):
        assert _run(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", st]).exit_code == 0
    assert _run(["tokenize", "--store", url, "--min-count", "3"]).exit_code == 0
    kept = _tokens(url)
    argv = [sys.executable, "-c", "from vsekit.cli import main; main()", "tokenize", "--store", url, "--min-count"]
    env = {**os.environ, **s3.env, "VSEKIT_FAULT": "tokenize:swap"}
    assert subprocess.run([*argv, "2"], env=env, capture_output=True, timeout=120).returncode == 137
    assert _tokens(url) == kept and not any(SWAP_MARK in k for k in s3.keys())
    env["VSEKIT_FAULT"] = "tokenize:publish"
    assert subprocess.run([*argv, "2"], env=env, capture_output=True, timeout=120).returncode == 137
    assert not FeatureStore.open(url).has_tokens and any(SWAP_MARK in k for k in s3.keys())
    r = _run(["info", url])
    assert r.exit_code == 0 and "tokens: being replaced (a tokenize stopped in its swap)" in r.output, r.output
    # the next tokenize (other settings) finishes that swap, then replaces it with its own tokens
    r = _run(["tokenize", "--store", url, "--min-count", "1"])
    assert r.exit_code == 0, r.output
    assert _run(["tokenize", "--store", disk, "--min-count", "1"]).exit_code == 0
    assert _tokens(url) == _tokens(disk)
    _clean_after(s3)
    assert not [k for k in s3.keys() if "tokens_partial" in k or SWAP_MARK in k]
