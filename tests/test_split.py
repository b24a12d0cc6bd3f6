"""Splits are metadata (issue 34): `vsekit split` re-splits a store and keeps every feature set; the
sets whose statistics came from a split that changed are refused as stale until remade; `ingest
--overwrite` does not drop extracted features without `--drop-features`.

Each test fails on the code before the issue (there was no `split` command, and `--overwrite`
silently deleted every feature set).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage.store import DONE, FAILED, SPLITS, FeatureStore, StoreError

N = 14


def _store(tmp_path: Path) -> FeatureStore:
    """14 images (train 12, val 1, test 1), one caption each, a 6-wide set whose row 13 failed."""
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="toy")
    store.write_images([f"im{i}" for i in range(N)], [f"{i}.jpg" for i in range(N)],
                       ["train"] * 12 + ["val", "test"])
    store.write_captions([f"a photo {i}" for i in range(N)], list(range(N)))
    x = np.random.default_rng(0).normal(size=(N, 6)).astype(np.float32) * 3 + 1
    status = np.full(N, DONE, np.uint8)
    status[12] = FAILED
    x[12] = 0
    fs = store.create_features("feat", (6,), np.float32, attrs={"kind": "global", "model": "toy"}, block_rows=4)
    for b in fs.blocks():
        fs.write_block(b, x[b.start:b.stop], status[b.start:b.stop])
    fs.record_errors({12: "truncated JPEG"})
    return store


def _split(*args):
    return CliRunner().invoke(main, ["split", *args])


def _codes(path) -> np.ndarray:
    return FeatureStore.open(path).image_splits()


def test_resplit_keeps_feature_sets_and_marks_train_statistics_stale(tmp_path):
    from vsekit.fne import discretize, standardize

    store = _store(tmp_path)
    standardize(store, "feat")
    discretize(store, "feat.z")
    before = {n: np.asarray(store.features(n).data[:]).copy() for n in ("feat", "feat.z", "feat.z.fne")}
    res = _split("--store", str(store.path), "--val", "3", "--test", "2", "--seed", "1")
    assert res.exit_code == 0, res.output
    codes = _codes(store.path)
    assert [int(np.sum(codes == i)) for i in range(3)] == [9, 3, 2]
    # the same seeded choice, computed independently: the first 3 of the permutation are val, next 2 test
    order = np.random.default_rng(1).permutation(N)
    assert set(np.flatnonzero(codes == 1)) == set(order[:3]) and set(np.flatnonzero(codes == 2)) == set(order[3:5])
    st = FeatureStore.open(store.path)
    assert st.feature_names() == ["feat", "feat.z", "feat.z.fne"]   # nothing dropped, nothing re-extracted
    for n, data in before.items():
        np.testing.assert_array_equal(st.features(n).data[:], data)
    assert "STALE feat.z:" in res.output and "STALE feat.z.fne:" in res.output
    assert "vsekit standardize --store" in res.output and "--overwrite" in res.output
    hist = st.attrs["split_history"][-1]
    assert hist["val"] == 3 and hist["seed"] == 1 and hist["before"]["train"] == 12 and hist["after"]["val"] == 3
    assert st.features("feat").attrs.get("stale") is None
    info = CliRunner().invoke(main, ["info", str(store.path)]).output
    assert "STALE: its mean/std came from split 'train' before `vsekit split` changed" in info
    assert "STALE: made from 'feat.z', which is stale" in info
    # a stale set is refused by its readers, with the commands that remake it
    for cmd in (["discretize", "--store", str(store.path), "--features", "feat.z", "--name", "q"],
                ["export", "vsepp", "--store", str(store.path), "--features", "feat.z.fne", "--out",
                 str(tmp_path / "out"), "--captions-per-image", "1", "--drop-failed"],
                ["standardize", "--store", str(store.path), "--features", "feat"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 1 and "is stale" in r.output, (cmd, r.output)
    from vsekit.train.data import open_features

    with pytest.raises(StoreError, match="'feat.z.fne' is stale: made from 'feat.z'"):
        open_features(st, "feat.z.fne", st.split_rows("train"))
    # remaking them clears the mark; the new statistics are the new train split's (numpy, float64)
    standardize(store.path, "feat", overwrite=True)
    discretize(store.path, "feat.z", overwrite=True)
    st = FeatureStore.open(store.path)
    assert not st.features("feat.z").attrs.get("stale") and not st.features("feat.z.fne").attrs.get("stale")
    x = np.asarray(st.features("feat").data[:], np.float64)
    use = (codes == 0) & (np.asarray(st.features("feat").status[:]) == DONE)
    np.testing.assert_allclose(st.features("feat.z").array("mean")[:], x[use].mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st.features("feat.z").array("std")[:], x[use].std(axis=0), rtol=1e-5, atol=1e-6)


def test_a_resplit_that_keeps_the_train_rows_keeps_the_statistics_valid(tmp_path):
    from vsekit.fne import standardize

    store = _store(tmp_path)
    standardize(store, "feat")
    table = tmp_path / "swap.tsv"   # val and test swapped; train untouched
    names = ["train"] * 12 + ["test", "val"]
    table.write_text("".join(f"im{i}\t{s}\n" for i, s in enumerate(names)))
    res = _split("--store", str(store.path), "--split-file", str(table))
    assert res.exit_code == 0, res.output
    assert list(_codes(store.path)) == [SPLITS.index(s) for s in names]
    assert "STALE" not in res.output
    assert not FeatureStore.open(store.path).features("feat.z").attrs.get("stale")
    # a file that misses an image is refused, and nothing changes
    table.write_text("im0\ttrain\n")
    res = _split("--store", str(store.path), "--split-file", str(table))
    assert res.exit_code == 1 and "13 of the store's 14 images have no split" in res.output
    assert list(_codes(store.path)) == [SPLITS.index(s) for s in names]


def test_ratios_give_ingest_folders_assignment_and_dry_run_changes_nothing(tmp_path):
    from vsekit.storage.sources.folder import assign_splits

    store = _store(tmp_path)
    old = _codes(store.path).copy()
    res = _split("--store", str(store.path), "--ratios", "0.5,0.25,0.25", "--seed", "3", "--dry-run")
    assert res.exit_code == 0 and res.output.startswith("would re-split"), res.output
    np.testing.assert_array_equal(_codes(store.path), old)
    res = _split("--store", str(store.path), "--ratios", "0.5,0.25,0.25", "--seed", "3")
    assert res.exit_code == 0, res.output
    want = [SPLITS.index(s) for s in assign_splits(N, (0.5, 0.25, 0.25), 3)]
    assert list(_codes(store.path)) == want
    assert "feat: failed rows by split:" in res.output
    res = _split("--store", str(store.path), "--ratios", "0.5,0.25,0.25", "--val", "2")
    assert res.exit_code == 1 and "give one of --ratios" in res.output


def _karpathy(tmp_path: Path) -> Path:
    from PIL import Image

    root = tmp_path / "data"
    root.mkdir()
    images = []
    for i in range(6):
        Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(root / f"{i}.jpg")
        images.append({"filename": f"{i}.jpg", "imgid": i, "split": "train" if i < 4 else "val",
                       "sentences": [{"raw": f"a red square {i}"}]})
    path = root / "dataset.json"
    path.write_text(json.dumps({"images": images}))
    return path


def test_ingest_overwrite_refuses_to_drop_feature_sets_without_drop_features(tmp_path):
    js = _karpathy(tmp_path)
    store = tmp_path / "s.zarr"
    assert CliRunner().invoke(main, ["ingest", "karpathy", str(js), "--store", str(store)]).exit_code == 0
    st = FeatureStore.open(store, mode="r+")
    fs = st.create_features("feat", (2,), np.float32, attrs={"kind": "global", "model": "toy"})
    fs.write_block(0, np.ones((6, 2), np.float32))
    res = CliRunner().invoke(main, ["ingest", "karpathy", str(js), "--store", str(store), "--overwrite"])
    assert res.exit_code == 1 and res.output.count("Error:") == 1, res.output
    assert "1 feature set (feat)" in res.output and "--drop-features" in res.output
    assert "vsekit split --store" in res.output
    assert FeatureStore.open(store).feature_names() == ["feat"]   # nothing lost
    res = CliRunner().invoke(main, ["ingest", "karpathy", str(js), "--store", str(store), "--overwrite",
                                    "--drop-features"])
    assert res.exit_code == 0, res.output
    assert "dropped 1 feature set: feat" in res.output
    assert FeatureStore.open(store).feature_names() == []


def test_a_pipeline_reruns_a_set_that_a_resplit_made_stale(tmp_path):
    from vsekit.fne import standardize
    from vsekit.pipeline.outputs import FeaturesOutput

    store = _store(tmp_path)
    standardize(store, "feat")
    out = FeaturesOutput(str(store.path), "feat.z")
    out.write("p/standardize", {"fingerprint": "abc"})
    assert out.read("p/standardize")["fingerprint"] == "abc"
    assert _split("--store", str(store.path), "--val", "4", "--test", "1").exit_code == 0
    assert out.read("p/standardize")["fingerprint"] != "abc"   # the plan sees it changed: rerun, overwrite


def test_the_vocabulary_of_changed_splits_is_flagged_and_tokenize_clears_it(tmp_path):
    from vsekit.tokenize import tokenize
    from vsekit.train.data import FeatureSource, training_rows

    store = _store(tmp_path)
    tokenize(store, min_count=1)   # vocabulary from train,val
    res = _split("--store", str(store.path), "--val", "3", "--test", "2")
    assert res.exit_code == 0 and "note: the vocabulary was counted on the captions of train,val" in res.output
    st = FeatureStore.open(store.path)
    said: list[str] = []
    training_rows(st, FeatureSource(st.features("feat")), "train", "val", said.append)
    assert any(s.startswith("note: the vocabulary was counted") for s in said), said
    tokenize(st.path, min_count=1)
    assert not FeatureStore.open(store.path).root["tokens"].attrs.get("stale")


def test_a_resplit_is_refused_while_a_writer_works_in_the_store(tmp_path):
    from vsekit.storage.lock import writer_lock

    store = _store(tmp_path)
    old = _codes(store.path).copy()
    with writer_lock(store.path, "feat.z", stage="vsekit standardize"):
        res = _split("--store", str(store.path), "--val", "3", "--test", "2")
    assert res.exit_code == 1 and "'feat.z' in it is being written" in res.output, res.output
    np.testing.assert_array_equal(_codes(store.path), old)


def test_val_alone_keeps_the_test_images_and_draws_val_from_the_rest(tmp_path):
    store = _store(tmp_path)
    old = _codes(store.path).copy()
    res = _split("--store", str(store.path), "--val", "4", "--seed", "2")
    assert res.exit_code == 0, res.output
    codes = _codes(store.path)
    assert np.array_equal(codes == 2, old == 2)   # test untouched
    pool = np.flatnonzero(old != 2)
    want = set(pool[np.random.default_rng(2).permutation(len(pool))][:4])
    assert set(np.flatnonzero(codes == 1)) == want and int((codes == 0).sum()) == N - 1 - 4
    assert FeatureStore.open(store.path).attrs["split_history"][-1]["kept"] == "test"
