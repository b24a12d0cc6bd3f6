"""Image paths that leave the image root (issue 23, finding 6): every COCO path candidate is
checked (``x_.._secret.jpg`` would otherwise be read as ``../x_.._secret.jpg``, and a symlinked
``val2014/`` followed), and extract checks again when it opens the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore


def _coco(tmp_path: Path, file_names: list[str]) -> tuple[Path, Path]:
    ann = tmp_path / "captions.json"
    ann.write_text(json.dumps({
        "images": [{"id": k, "file_name": f} for k, f in enumerate(file_names)],
        "annotations": [{"image_id": k, "caption": f"a picture {k}"} for k in range(len(file_names))]}))
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({str(k): "train" for k in range(len(file_names))}))
    return ann, splits


def _ingest_coco(ann: Path, splits: Path, root: Path, store: Path, *more: str):
    return CliRunner().invoke(main, ["ingest", "coco", str(ann), "--split-file", str(splits), "--image-root", str(root),
                                     "--store", str(store), *more])


@pytest.fixture()
def root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "COCO_val2014_000000000000.jpg").write_bytes(b"x")
    return root


def test_coco_second_candidate_leaving_the_root_is_refused(tmp_path, root):
    (tmp_path / "x_.._secret.jpg").write_bytes(b"secret")   # where root/../x_.._secret.jpg points
    ann, splits = _coco(tmp_path, ["COCO_val2014_000000000000.jpg", "x_.._secret.jpg"])
    store = tmp_path / "s.zarr"
    r = _ingest_coco(ann, splits, root, store)
    assert r.exit_code == 1 and f"{ann}: images[1].file_name" in r.output, r.output
    assert "outside the image root" in r.output and "--allow-outside-root" in r.output and not store.exists()
    r = _ingest_coco(ann, splits, root, store, "--allow-outside-root")
    assert r.exit_code == 0, r.output
    assert list(FeatureStore.open(store).image_paths()) == ["COCO_val2014_000000000000.jpg", "../x_.._secret.jpg"]


def test_coco_symlinked_set_folder_pointing_out_is_refused(tmp_path, root):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "COCO_val2014_000000000001.jpg").write_bytes(b"secret")
    (root / "val2014").symlink_to(elsewhere, target_is_directory=True)
    (root / "a.jpg").write_bytes(b"x")
    ann, splits = _coco(tmp_path, ["a.jpg", "COCO_val2014_000000000001.jpg"])
    store = tmp_path / "s.zarr"
    r = _ingest_coco(ann, splits, root, store)
    assert r.exit_code == 1 and f"{ann}: images[1].file_name" in r.output, r.output
    assert f"resolves to {elsewhere.resolve()}" in r.output and not store.exists()
    r = _ingest_coco(ann, splits, root, store, "--allow-outside-root")
    assert r.exit_code == 0, r.output


def test_image_swapped_for_an_outward_symlink_after_ingest_is_refused_at_extract(demo_dir, tmp_path):
    pytest.importorskip("torch")
    from vsekit.extract import extract

    root = tmp_path / "root"
    root.mkdir()
    jpgs = sorted(p for p in demo_dir.rglob("*.jpg"))[:3]
    recs = []
    for k, src in enumerate(jpgs):
        shutil.copy(src, root / f"{k}.jpg")
        recs.append({"filename": f"{k}.jpg", "split": "train", "imgid": k, "sentences": [{"raw": "a cat"}]})
    (tmp_path / "k.json").write_text(json.dumps({"images": recs}))
    outside = tmp_path / "secret.jpg"
    shutil.copy(jpgs[0], outside)
    kw = dict(weights="none", input_size=32, resize=36, batch_size=4, workers=0, progress=False)
    for allow in (False, True):
        store = tmp_path / f"s{int(allow)}.zarr"
        args = ["ingest", "karpathy", str(tmp_path / "k.json"), "--image-root", str(root), "--store", str(store)]
        r = CliRunner().invoke(main, args + (["--allow-outside-root"] if allow else []))
        assert r.exit_code == 0, r.output
        (root / "1.jpg").unlink()
        (root / "1.jpg").symlink_to(outside)             # swapped after the ingest
        res = extract(store, "test_resnet", "global", **kw)
        if allow:
            assert res.failed == 0 and res.done == 3
        else:
            assert res.done == 2 and res.failed == 1 and list(res.errors) == [1]
            assert "outside the image root" in res.errors[1] and str(outside) in res.errors[1]
            status = FeatureStore.open(store).features("test_resnet_global").status[:]
            assert list(status) == [1, 2, 1]
        (root / "1.jpg").unlink()
        shutil.copy(jpgs[1], root / "1.jpg")
