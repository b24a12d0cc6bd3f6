"""`vsekit ingest parquet`: files written by pyarrow in img2dataset's and HF datasets' layouts."""

from __future__ import annotations

import io

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.extract.reader import decode
from vsekit.storage import FeatureStore

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _jpeg(rng, side=16) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_img2dataset_parquet_bytes_read_in_place(tmp_path):
    rng = np.random.default_rng(0)
    n = 10
    jpgs = [_jpeg(rng) for _ in range(n)]
    jpgs[4] = None  # a failed download: img2dataset keeps the row with status != success
    table = pa.table({
        "url": [f"http://x/{i}.jpg" for i in range(n)],
        "caption": [f"caption {i}" for i in range(n)],
        "key": [f"{i:09d}" for i in range(n)],
        "status": ["success" if j else "failed_to_download" for j in jpgs],
        "jpg": pa.array(jpgs, type=pa.binary()),
    })
    pq.write_table(table, tmp_path / "00000.parquet", row_group_size=3)  # several row groups
    r = CliRunner().invoke(main, ["ingest", "parquet", str(tmp_path / "00000.parquet"), "--split", "test",
                                  "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 0, r.output
    assert "row 4: no image bytes in column 'jpg'" in r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    keep = [i for i in range(n) if jpgs[i]]
    assert list(store.image_ids()) == [f"{i:09d}" for i in keep]
    assert list(store.caption_text()) == [f"caption {i}" for i in keep]
    for row, i in enumerate(keep):
        assert np.array_equal(np.asarray(decode(str(store.image_file(row)))), _pixels(jpgs[i]))
    assert not list(tmp_path.glob("s.zarr/**/*.jpg"))


def test_hf_export_struct_images_caption_lists_and_splits(tmp_path):
    rng = np.random.default_rng(1)
    on_disk = _jpeg(rng)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "c.jpg").write_bytes(on_disk)
    images = [{"bytes": _jpeg(rng), "path": "a.jpg"}, {"bytes": _jpeg(rng), "path": "b.jpg"},
              {"bytes": None, "path": "imgs/c.jpg"}]
    table = pa.table({
        "image": pa.array(images, type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        "caption": [["a dog  runs", "the dog"], ["a cat"], ["a car", "red car", "fast car"]],
        "img_id": ["10", "11", "12"],
        "split": ["train", "dev", "test"],
    })
    pq.write_table(table, tmp_path / "flickr.parquet")
    r = CliRunner().invoke(main, ["ingest", "parquet", str(tmp_path / "flickr.parquet"),
                                  "--id-column", "img_id", "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 0, r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    assert list(store.image_ids()) == ["10", "11", "12"]
    assert [int(c) for c in store.image_splits()] == [0, 1, 2]  # dev is val
    assert list(store.caption_text()) == ["a dog runs", "the dog", "a cat", "a car", "red car", "fast car"]
    assert list(store.caption_images()) == [0, 0, 1, 2, 2, 2]
    for row, data in enumerate([images[0]["bytes"], images[1]["bytes"], on_disk]):
        assert np.array_equal(np.asarray(decode(str(store.image_file(row)))), _pixels(data))
    assert str(store.image_paths()[2]) == "imgs/c.jpg"


def test_caption_per_row_paths_and_errors(tmp_path):
    rng = np.random.default_rng(2)
    for name in ("x.jpg", "y.jpg"):
        (tmp_path / name).write_bytes(_jpeg(rng))
    pq.write_table(pa.table({"filepath": ["x.jpg", "y.jpg", "x.jpg", "missing.jpg"],
                             "text": ["one", "two", "three", "four"]}), tmp_path / "t.parquet")
    run = CliRunner().invoke
    r = run(main, ["ingest", "parquet", str(tmp_path), "--split", "train", "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 0, r.output
    assert "missing.jpg is missing" in r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    assert list(store.image_ids()) == ["x", "y"]
    assert list(store.caption_images()) == [0, 1, 0]
    pq.write_table(pa.table({"jpg": [b"1"], "caption": ["c"], "split": ["holdout"]}), tmp_path / "bad.parquet")
    r = run(main, ["ingest", "parquet", str(tmp_path / "bad.parquet"), "--store", str(tmp_path / "b.zarr")])
    assert r.exit_code == 1 and "row 0: unknown split 'holdout'" in r.output and "Traceback" not in r.output
    r = run(main, ["ingest", "parquet", str(tmp_path / "bad.parquet"), "--caption-column", "nope",
                   "--store", str(tmp_path / "b.zarr")])
    assert r.exit_code == 1 and "no column 'nope' (--caption-column)" in r.output
    (tmp_path / "junk.parquet").write_text("not parquet")
    r = run(main, ["ingest", "parquet", str(tmp_path / "junk.parquet"), "--store", str(tmp_path / "b.zarr")])
    assert r.exit_code == 1 and "not a parquet file" in r.output
