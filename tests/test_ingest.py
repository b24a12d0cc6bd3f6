"""Every ingest format, on files these tests write in that format, and every bad input of issue #2."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.storage import (
    FeatureStore, IngestError, StoreError, ingest_butd, ingest_coco, ingest_folder, ingest_karpathy, ingest_precomp,
)


def _jpeg(path: Path, colour=(200, 10, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)


def _no_store_left(path: Path) -> None:
    assert not path.exists()
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.partial")]


# karpathy ------------------------------------------------------------------------------------------
def _karpathy(tmp_path: Path, records: list[dict]) -> Path:
    p = tmp_path / "dataset_x.json"
    p.write_text(json.dumps({"dataset": "x", "images": records}))
    return p


def _krec(i, split="train", caps=("a cat", "a dog"), make=True, root=None):
    if make:
        _jpeg(root / "imgs" / f"{i}.jpg")
    return {"filepath": "imgs", "filename": f"{i}.jpg", "split": split, "cocoid": i,
            "sentences": [{"raw": c} for c in caps]}


def test_karpathy_restval_and_skips(tmp_path):
    recs = [_krec(1, "train", root=tmp_path), _krec(2, "restval", root=tmp_path),
            _krec(3, "test", caps=("x", "  "), root=tmp_path), _krec(4, "val", make=False, root=tmp_path)]
    p = _karpathy(tmp_path, recs)
    store, report = ingest_karpathy(p, tmp_path, tmp_path / "k.zarr")
    assert list(store.image_ids()) == ["1", "2", "3"]
    assert list(store.image_splits()) == [0, 3, 2]
    assert list(store.caption_text()) == ["a cat", "a dog", "a cat", "a dog", "x"]
    assert any("images[3]" in s and "missing" in s for s in report.skipped)
    assert any("images[2].sentences[1]: empty caption" in s for s in report.skipped)
    store2, _ = ingest_karpathy(p, tmp_path, tmp_path / "k2.zarr", restval_as_train=True)
    assert list(store2.image_splits()) == [0, 0, 2]


def test_karpathy_bad_inputs(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"images": [\n {"filename": "a.jpg",, }]}')
    with pytest.raises(IngestError, match=r"bad.json: malformed JSON at line 2, column"):
        ingest_karpathy(p, tmp_path, tmp_path / "s.zarr")
    p = _karpathy(tmp_path, [_krec(1, root=tmp_path), _krec(1, root=tmp_path)])
    with pytest.raises(IngestError, match=r"images\[1\]: duplicate image id 1"):
        ingest_karpathy(p, tmp_path, tmp_path / "s.zarr")
    p = _karpathy(tmp_path, [_krec(1, root=tmp_path), _krec(2, make=False, root=tmp_path)])
    with pytest.raises(IngestError, match=r"images\[1\]: image file .*2.jpg is missing.*--strict"):
        ingest_karpathy(p, tmp_path, tmp_path / "s.zarr", strict=True)
    _no_store_left(tmp_path / "s.zarr")


# coco ----------------------------------------------------------------------------------------------
def _coco_files(tmp_path: Path):
    root = tmp_path / "coco"
    docs = {}
    for part, ids in (("train2014", [1, 2, 3]), ("val2014", [4, 5])):
        images = []
        for i in ids:
            name = f"COCO_{part}_{i:012d}.jpg"
            _jpeg(root / part / name)
            images.append({"id": i, "file_name": name, "width": 8, "height": 8})
        anns = [{"id": 100 * i + j, "image_id": i, "caption": f"image {i} caption {j}\n"}
                for i in ids for j in range(2)]
        docs[part] = root / f"captions_{part}.json"
        docs[part].write_text(json.dumps({"images": images, "annotations": anns}))
    return root, [docs["train2014"], docs["val2014"]]


SPLITS = {"1": "train", "2": "train", "3": "restval", "4": "val", "5": "test"}


@pytest.mark.parametrize("form", ["karpathy", "tsv", "json"])
def test_coco_with_each_split_file_form(tmp_path, form):
    root, anns = _coco_files(tmp_path)
    if form == "karpathy":
        split_file = tmp_path / "dataset_coco.json"
        split_file.write_text(json.dumps({"images": [{"cocoid": int(k), "split": v, "filename": "x"}
                                                     for k, v in SPLITS.items()]}))
    elif form == "tsv":
        split_file = tmp_path / "splits.tsv"
        split_file.write_text("image_id\tsplit\n" + "".join(f"{k}\t{v}\n" for k, v in SPLITS.items()))
    else:
        split_file = tmp_path / "splits.json"
        split_file.write_text(json.dumps(SPLITS))
    store, report = ingest_coco(anns, split_file, root, tmp_path / "c.zarr", restval_as_train=True)
    assert report.skipped == []
    assert list(store.image_ids()) == ["1", "2", "3", "4", "5"]
    assert list(store.image_paths())[3] == "val2014/COCO_val2014_000000000004.jpg"
    assert store.image_file(0).is_file()
    assert list(store.image_splits()) == [0, 0, 0, 1, 2]
    assert store.n_captions == 10
    assert store.caption_text()[9] == "image 5 caption 1"
    assert list(store.caption_images()) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_coco_bad_inputs(tmp_path):
    root, anns = _coco_files(tmp_path)
    doc = json.loads(anns[1].read_text())
    doc["annotations"].append({"id": 9, "image_id": 77, "caption": "who am i"})
    doc["annotations"].append({"id": 10, "image_id": 4, "caption": "   "})
    doc["images"].append({"id": 6, "file_name": "COCO_val2014_000000000006.jpg"})  # file not on disk
    anns[1].write_text(json.dumps(doc))
    split_file = tmp_path / "splits.json"
    split_file.write_text(json.dumps({**SPLITS, "6": "test"}))
    del_split = {k: v for k, v in {**SPLITS, "6": "test"}.items() if k != "2"}
    split2 = tmp_path / "splits2.json"
    split2.write_text(json.dumps(del_split))
    store, report = ingest_coco(anns, split2, root, tmp_path / "c.zarr")
    text = "\n".join(report.skipped)
    assert "captions_val2014.json: annotations[4]: caption for unknown image id 77" in text
    assert "captions_val2014.json: annotations[5]: empty caption for image 4" in text
    assert "captions_val2014.json: images[2]: image file" in text and "missing" in text
    assert "captions_train2014.json: images[1]: image id 2 has no split" in text
    assert list(store.image_ids()) == ["1", "3", "4", "5"]
    assert "skipped 4" in report.summary()
    with pytest.raises(IngestError, match=r"captions_val2014.json: images\[2\]: image file .* is missing"):
        ingest_coco(anns, split_file, root, tmp_path / "strict.zarr", strict=True)
    _no_store_left(tmp_path / "strict.zarr")
    # a duplicate image id across files
    doc["images"].append({"id": 1, "file_name": "COCO_val2014_000000000001.jpg"})
    anns[1].write_text(json.dumps(doc))
    with pytest.raises(IngestError, match=r"captions_val2014.json: images\[3\]: duplicate image id 1 "
                                          r"\(first at .*captions_train2014.json: images\[0\]\)"):
        ingest_coco(anns, split_file, root, tmp_path / "dup.zarr")
    bad = tmp_path / "bad_splits.tsv"
    bad.write_text("1\ttrain\n2\tholdout\n")
    with pytest.raises(IngestError, match=r"bad_splits.tsv:2: unknown split 'holdout'"):
        ingest_coco(anns, bad, root, tmp_path / "x.zarr")


# folder --------------------------------------------------------------------------------------------
def _folder(tmp_path: Path, n=10):
    d = tmp_path / "pics"
    for i in range(n):
        _jpeg(d / "sub" / f"p{i}.jpg")
    return d


def test_folder_with_split_column(tmp_path):
    d = _folder(tmp_path, 3)
    tsv = tmp_path / "caps.tsv"
    tsv.write_text("path\tcaption\tsplit\n" "sub/p0.jpg\ta red  square\ttrain\n" "sub/p1.jpg\tone\tval\n"
                   "sub/p0.jpg\tsecond caption\ttrain\n" "sub/p2.jpg\tthree\ttest\n")
    store, report = ingest_folder(d, tsv, tmp_path / "f.zarr")
    assert report.skipped == []
    assert list(store.image_ids()) == ["sub/p0", "sub/p1", "sub/p2"]
    assert list(store.image_splits()) == [0, 1, 2]
    assert list(store.caption_text()) == ["a red square", "one", "second caption", "three"]
    assert list(store.caption_images()) == [0, 1, 0, 2]


def test_folder_csv_random_split_is_seeded(tmp_path):
    d = _folder(tmp_path, 10)
    csv_path = tmp_path / "caps.csv"
    csv_path.write_text("".join(f'sub/p{i}.jpg,"a shape, number {i}"\n' for i in range(10)))
    s1, _ = ingest_folder(d, csv_path, tmp_path / "a.zarr", ratios="0.6,0.2,0.2", seed=3)
    s2, _ = ingest_folder(d, csv_path, tmp_path / "b.zarr", ratios="0.6,0.2,0.2", seed=3)
    s3, _ = ingest_folder(d, csv_path, tmp_path / "c.zarr", ratios="0.6,0.2,0.2", seed=4)
    assert s1.caption_text()[4] == "a shape, number 4"
    codes = s1.image_splits()
    assert np.bincount(codes, minlength=3).tolist() == [6, 2, 2]
    assert np.array_equal(codes, s2.image_splits())
    # independent reference: the first 6 of a seeded permutation are train, the next 2 val
    order = np.random.default_rng(3).permutation(10)
    assert set(np.flatnonzero(codes == 0)) == set(order[:6].tolist())
    assert not np.array_equal(codes, s3.image_splits())
    with pytest.raises(ValueError, match="--split '0.5,0.1': expected three"):
        ingest_folder(d, csv_path, tmp_path / "d.zarr", ratios="0.5,0.1")


def test_folder_bad_lines(tmp_path):
    d = _folder(tmp_path, 3)
    tsv = tmp_path / "caps.tsv"
    tsv.write_bytes(b"sub/p0.jpg\tfine\n" b"just one field\n" b"sub/p1.jpg\t\xff\xfe broken\n"
                    b"sub/missing.jpg\ta caption\n" b"sub/p2.jpg\t   \n" b"sub/p2.jpg\tok\n")
    store, report = ingest_folder(d, tsv, tmp_path / "f.zarr")
    text = "\n".join(report.skipped)
    assert f"{tsv}:2: unreadable line" in text
    assert f"{tsv}:3: unreadable line (UnicodeDecodeError" in text
    assert f"{tsv}:4: image file" in text and "missing.jpg is missing" in text
    assert f"{tsv}:5: empty caption for image sub/p2.jpg" in text
    assert list(store.caption_text()) == ["fine", "ok"]
    with pytest.raises(IngestError, match=f"{tsv}:2: unreadable line"):
        ingest_folder(d, tsv, tmp_path / "s.zarr", strict=True)
    _no_store_left(tmp_path / "s.zarr")
    tsv.write_text("sub/p0.jpg\ta\ttrain\nsub/p0.jpg\tb\ttest\n")
    with pytest.raises(IngestError, match=r"caps.tsv:2: image sub/p0.jpg is in split 'test' here"):
        ingest_folder(d, tsv, tmp_path / "s.zarr")
    (d / "sub" / "p0.png").write_bytes((d / "sub" / "p0.jpg").read_bytes())
    tsv.write_text("sub/p0.jpg\ta\nsub/p0.png\tb\n")
    with pytest.raises(IngestError, match=r"caps.tsv:2: duplicate image id 'sub/p0'"):
        ingest_folder(d, tsv, tmp_path / "s.zarr")


# precomp -------------------------------------------------------------------------------------------
def _precomp(folder: Path, prefix: str, feats: np.ndarray, caps: list[str], ids=None, repeat=False):
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / f"{prefix}_ims.npy", np.repeat(feats, 5, axis=0) if repeat else feats)
    (folder / f"{prefix}_caps.txt").write_text("".join(c + "\n" for c in caps))
    if ids is not None:
        (folder / f"{prefix}_ids.txt").write_text("".join(f"{i}\n" for i in ids))


def _caps(prefix, n):
    return [f"{prefix} image {i} caption {j}" for i in range(n) for j in range(5)]


@pytest.mark.parametrize("repeat", [False, True])
def test_precomp_vsepp(tmp_path, repeat):
    rng = np.random.default_rng(0)
    tr, dv, te = (rng.normal(size=(n, 6)).astype(np.float32) for n in (4, 2, 3))
    for prefix, f in (("train", tr), ("dev", dv), ("test", te)):
        _precomp(tmp_path / "p", prefix, f, _caps(prefix, len(f)), repeat=repeat)
    store, report = ingest_precomp(tmp_path / "p", tmp_path / "s.zarr")
    assert report.skipped == []
    fs = store.features("precomp", {"kind": "global"}, complete=True)
    assert fs.data.dtype == np.float32
    assert np.array_equal(fs.data[:], np.concatenate([tr, dv, te]))
    assert list(store.image_splits()) == [0] * 4 + [1] * 2 + [2] * 3
    assert list(store.image_ids())[:2] == ["train_0", "train_1"]
    assert store.caption_text()[27] == "dev image 1 caption 2"
    assert store.caption_images()[27] == 5
    assert store.n_captions == 45


def test_precomp_scan_regions_with_ids(tmp_path):
    rng = np.random.default_rng(1)
    tr, te = rng.normal(size=(3, 36, 8)).astype(np.float32), rng.normal(size=(2, 36, 8)).astype(np.float32)
    _precomp(tmp_path / "p", "train", tr, _caps("train", 3), ids=[11, 12, 13])
    _precomp(tmp_path / "p", "test", te, _caps("test", 2), ids=[21] * 5 + [22] * 5)  # one id per caption
    store, _ = ingest_precomp(tmp_path / "p", tmp_path / "s.zarr", name="scan")
    fs = store.features("scan", {"kind": "regions"})
    assert fs.shape == (5, 36, 8) and fs.data.dtype == np.float16
    assert np.array_equal(fs.data[:], np.concatenate([tr, te]).astype(np.float16))
    assert fs.array("count")[:].tolist() == [36] * 5
    assert not fs.array("boxes")[:].any()
    assert list(store.image_ids()) == ["11", "12", "13", "21", "22"]


def test_precomp_bad_inputs(tmp_path):
    f = np.zeros((3, 4), np.float32)
    _precomp(tmp_path / "p", "train", f, _caps("train", 3)[:-5] + ["", "b", "c", "d", "e"])
    (tmp_path / "p" / "train_caps.txt").write_text("".join(c + "\n" for c in _caps("train", 2)))
    with pytest.raises(IngestError, match=r"train_ims.npy: 3 rows do not match the 10 captions in "
                                          r".*train_caps.txt"):
        ingest_precomp(tmp_path / "p", tmp_path / "s.zarr")
    _no_store_left(tmp_path / "s.zarr")
    caps = _caps("train", 3)
    caps[7] = "  "
    _precomp(tmp_path / "p", "train", f, caps)
    store, report = ingest_precomp(tmp_path / "p", tmp_path / "s.zarr")
    assert report.skipped == [f"{tmp_path / 'p' / 'train_caps.txt'}:8: empty caption"]
    assert store.n_captions == 14
    with pytest.raises(IngestError, match="train_caps.txt:8: empty caption"):
        ingest_precomp(tmp_path / "p", tmp_path / "t.zarr", strict=True)
    np.save(tmp_path / "p" / "train_ims.npy", np.arange(15 * 4, dtype=np.float32).reshape(15, 4))
    with pytest.raises(IngestError, match="has one row per caption .* but rows 0..4 differ"):
        ingest_precomp(tmp_path / "p", tmp_path / "t.zarr")
    _precomp(tmp_path / "p", "train", f, _caps("train", 3), ids=[1, 2, 1])
    with pytest.raises(IngestError, match=r"train_ids.txt:3: duplicate image id 1"):
        ingest_precomp(tmp_path / "p", tmp_path / "t.zarr")


# butd ----------------------------------------------------------------------------------------------
def _b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def _butd(path: Path, items: list[tuple[str, np.ndarray, np.ndarray]], extra_lines=()):
    with open(path, "w") as f:
        for image_id, boxes, feats in items:
            f.write(f"{image_id}\t640\t480\t{len(boxes)}\t{_b64(boxes)}\t{_b64(feats)}\n")
        for line in extra_lines:
            f.write(line + "\n")


def _items(ids, counts, c=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(str(i), rng.uniform(0, 400, size=(n, 4)), rng.normal(size=(n, c))) for i, n in zip(ids, counts)]


def test_butd_new_store_fixed_and_adaptive(tmp_path):
    fixed = _items(["a", "b", "c"], [36, 36, 36])
    _butd(tmp_path / "fixed.tsv", fixed)
    store, report = ingest_butd([tmp_path / "fixed.tsv"], tmp_path / "f.zarr", split_file=None)
    fs = store.features("regions", {"kind": "regions"}, complete=True)
    assert fs.shape == (3, 36, 8)
    assert np.array_equal(fs.data[:], np.stack([x[2] for x in fixed]).astype(np.float16))
    assert np.allclose(fs.array("boxes")[:], np.stack([x[1] for x in fixed]).astype(np.float32))
    assert fs.attrs["adaptive"] is False
    counts = [10, 100, 37, 55]
    adaptive = _items(["1", "2", "3", "4"], counts, seed=1)
    _butd(tmp_path / "a1.tsv", adaptive[:2])
    _butd(tmp_path / "a2.tsv", adaptive[2:])
    splits = tmp_path / "s.tsv"
    splits.write_text("1\ttrain\n2\ttrain\n3\tval\n4\ttest\n")
    store, _ = ingest_butd([tmp_path / "a1.tsv", tmp_path / "a2.tsv"], tmp_path / "a.zarr",
                           split_file=splits, dtype="float32")
    fs = store.features("regions")
    assert fs.shape == (4, 100, 8) and fs.attrs["adaptive"] is True
    assert fs.array("count")[:].tolist() == counts
    assert list(store.image_splits()) == [0, 0, 1, 2]
    data = fs.data[:]
    for row, (_, boxes, feats) in enumerate(adaptive):
        n = len(boxes)
        assert np.array_equal(data[row, :n], feats.astype(np.float32))
        assert not data[row, n:].any() and not fs.array("boxes")[row, n:].any()
    assert fs.array("image_size")[0].tolist() == [640, 480]
    from vsekit.storage.interop import export_precomp  # a caption-less store cannot become a precomp folder

    with pytest.raises(StoreError, match="has no captions; the scan layout needs 5 captions per image"):
        export_precomp(store, "regions", tmp_path / "out", layout="scan")


def test_butd_into_existing_store(demo_store, tmp_path):
    ids = list(demo_store.image_ids())
    items = _items([ids[5], ids[0], "nope", ids[7]], [36, 36, 36, 36])
    _butd(tmp_path / "r.tsv", items)
    before = demo_store.n_captions
    r = CliRunner().invoke(main, ["ingest", "butd", str(tmp_path / "r.tsv"), "--store", str(demo_store.path),
                                  "--name", "butd36"])
    assert r.exit_code == 0, r.output
    assert "r.tsv:3: image id nope is not in" in r.output
    store = FeatureStore.open(demo_store.path)
    assert store.n_captions == before
    fs = store.features("butd36")
    assert fs.counts() == {"pending": 0, "done": 3, "failed": len(ids) - 3}
    assert np.array_equal(fs.data[5], items[0][2].astype(np.float16))
    assert np.array_equal(fs.data[0], items[1][2].astype(np.float16))
    assert not fs.data[1].any()
    assert "no line" in fs.errors()[1]
    # a second ingest into the same name is refused; a strict failure leaves nothing behind
    r = CliRunner().invoke(main, ["ingest", "butd", str(tmp_path / "r.tsv"), "--store", str(demo_store.path),
                                  "--name", "butd36"])
    assert r.exit_code == 1 and "already exists" in r.output
    r = CliRunner().invoke(main, ["ingest", "butd", str(tmp_path / "r.tsv"), "--store", str(demo_store.path),
                                  "--name", "other", "--strict"])
    assert r.exit_code == 1 and "image id nope is not in" in r.output
    assert FeatureStore.open(demo_store.path).feature_names() == ["butd36"]
    assert sorted(p.name for p in (demo_store.path / "features").iterdir()) == ["butd36", "zarr.json"]


def test_butd_bad_lines(tmp_path):
    good = _items(["a", "b"], [36, 36])
    line = f"c\t640\t480\t36\t{_b64(good[0][1])}\t{_b64(good[0][2])}"
    truncated = line[: len(line) - 200]
    _butd(tmp_path / "x.tsv", good, extra_lines=[truncated, "d\t640\t480\tmany\tAAAA\tAAAA",
                                                 f"e\t640\t480\t36\t{_b64(good[0][1])}"])
    store, report = ingest_butd([tmp_path / "x.tsv"], tmp_path / "s.zarr")
    text = "\n".join(report.skipped)
    assert f"{tmp_path / 'x.tsv'}:3: " in text and "truncated line" in text
    assert f"{tmp_path / 'x.tsv'}:4: malformed line" in text
    assert f"{tmp_path / 'x.tsv'}:5: truncated line: 5 of 6" in text
    assert list(store.image_ids()) == ["a", "b"]
    with pytest.raises(IngestError, match="x.tsv:3: .*truncated line"):
        ingest_butd([tmp_path / "x.tsv"], tmp_path / "t.zarr", strict=True)
    _no_store_left(tmp_path / "t.zarr")
    _butd(tmp_path / "y.tsv", good + good[:1])
    with pytest.raises(IngestError, match=r"y.tsv:3: duplicate image id a \(first at .*y.tsv:1\)"):
        ingest_butd([tmp_path / "y.tsv"], tmp_path / "t.zarr")
    _butd(tmp_path / "z.tsv", _items(["a"], [101]))
    with pytest.raises(IngestError, match=r"num_boxes=101 is outside 1..100"):
        ingest_butd([tmp_path / "z.tsv"], tmp_path / "t.zarr", strict=True)


# the CLI -------------------------------------------------------------------------------------------
def test_cli_ingest_formats_and_errors(tmp_path):
    root, anns = _coco_files(tmp_path)
    (tmp_path / "s.json").write_text(json.dumps(SPLITS))
    r = CliRunner().invoke(main, ["ingest", "coco", *map(str, anns), "--split-file", str(tmp_path / "s.json"),
                                  "--image-root", str(root), "--store", str(tmp_path / "c.zarr")])
    assert r.exit_code == 0, r.output
    assert "ingested 5 images, 10 captions" in r.output
    d = _folder(tmp_path, 2)
    (tmp_path / "c.tsv").write_text("sub/p0.jpg\ta\nsub/p1.jpg\tb\nsub/p9.jpg\tc\n")
    r = CliRunner().invoke(main, ["ingest", "folder", str(d), str(tmp_path / "c.tsv"), "--ratios", "0.5,0.5,0",
                                  "--store", str(tmp_path / "f.zarr")])
    assert r.exit_code == 0, r.output
    assert "skipped 1" in r.output and "c.tsv:3" in r.output
    r = CliRunner().invoke(main, ["ingest", "folder", str(d), str(tmp_path / "c.tsv"), "--strict",
                                  "--store", str(tmp_path / "g.zarr")])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "c.tsv:3" in r.output
    _precomp(tmp_path / "p", "test", np.ones((2, 3), np.float32), _caps("test", 2))
    r = CliRunner().invoke(main, ["ingest", "precomp", str(tmp_path / "p"), "--store", str(tmp_path / "p.zarr")])
    assert r.exit_code == 0 and "ingested 2 images, 10 captions" in r.output
    r = CliRunner().invoke(main, ["ingest", "precomp", str(tmp_path / "p"), "--store", str(tmp_path / "p.zarr")])
    assert r.exit_code == 1 and "already exists" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{\"images\": [}")
    r = CliRunner().invoke(main, ["ingest", "karpathy", str(bad), "--store", str(tmp_path / "k.zarr")])
    assert r.exit_code == 1 and "bad.json: malformed JSON at line 1, column 13" in r.output


def test_precomp_into_existing_store(demo_store, tmp_path):
    ids = list(demo_store.image_ids())
    feats = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)
    _precomp(tmp_path / "p", "test", feats, _caps("test", 3), ids=[ids[9], "unknown", ids[2]])
    store, report = ingest_precomp(tmp_path / "p", demo_store.path, name="pc")
    assert any("test_ids.txt:2: image id unknown is not in" in s for s in report.skipped)
    fs = FeatureStore.open(demo_store.path).features("pc")
    assert fs.counts() == {"pending": 0, "done": 2, "failed": len(ids) - 2}
    assert np.array_equal(fs.data[9], feats[0]) and np.array_equal(fs.data[2], feats[2])
    assert not fs.data[0].any() and "no row" in fs.errors()[0]
    assert store.n_captions == demo_store.n_captions  # captions are the store's own
    with pytest.raises(IngestError, match="image id unknown is not in"):
        ingest_precomp(tmp_path / "p", demo_store.path, name="pc2", strict=True)
    assert FeatureStore.open(demo_store.path).feature_names() == ["pc"]
