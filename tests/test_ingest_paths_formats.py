"""`ingest parquet` / `ingest webdataset`: image paths that leave the image root are refused unless
`--allow-outside-root`, and a wrong image root gets an error that names the paths looked for."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.extract.reader import decode
from vsekit.storage import FeatureStore

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

_HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def _ingest(*args):
    return CliRunner().invoke(main, ["ingest", *map(str, args)])


def test_parquet_relative_paths_without_image_root_name_the_paths_tried(tmp_path):
    images = tmp_path / "flickr" / "images"
    images.mkdir(parents=True)
    names = [f"im{i}.jpg" for i in range(5)]
    for i, name in enumerate(names):
        (images / name).write_bytes(_jpeg(i))
    tables = tmp_path / "tables"
    tables.mkdir()
    pq.write_table(pa.table({"file_name": names, "caption": [f"c {i}" for i in range(5)]}), tables / "t.parquet")
    r = _ingest("parquet", tables / "t.parquet", "--split", "test", "--store", tmp_path / "s.zarr")
    assert r.exit_code == 1 and "Traceback" not in r.output
    error = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1, r.output
    assert "no usable rows" in error[0] and "--image-root" in error[0]
    assert f"under the image root {tables.resolve()}" in error[0]
    for name in names[:3]:  # a few of the paths it looked for
        assert str(tables.resolve() / name) in error[0]
    assert str(tables.resolve() / names[4]) not in error[0]
    assert not (tmp_path / "s.zarr").exists()
    r = _ingest("parquet", tables / "t.parquet", "--image-root", images, "--split", "test",
                "--store", tmp_path / "s.zarr")
    assert r.exit_code == 0, r.output
    assert [str(p) for p in FeatureStore.open(tmp_path / "s.zarr").image_paths()] == names


def _hf_table(root, outside):
    """An HF ``Image`` column: bytes in row 0, an absolute path inside the root in row 1, and in
    row 2 an absolute path outside it (as `datasets` writes for files in its cache)."""
    return pa.table({
        "image": pa.array([{"bytes": _jpeg(0), "path": "a.jpg"},
                           {"bytes": None, "path": str(root / "sub" / "b.jpg")},
                           {"bytes": None, "path": str(outside)}], type=_HF_IMAGE),
        "caption": ["a", "b", "c"],
        "id": ["0", "1", "2"],
    })


def test_parquet_hf_absolute_path_outside_root_is_refused_unless_allowed(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "b.jpg").write_bytes(_jpeg(1))
    cache = tmp_path / "cache"
    cache.mkdir()
    outside = cache / "c.jpg"
    outside.write_bytes(_jpeg(2))
    pq.write_table(_hf_table(root, outside), root / "hf.parquet")
    r = _ingest("parquet", root / "hf.parquet", "--split", "test", "--store", tmp_path / "s.zarr")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert f"row 2: image path {str(outside)!r} in column 'image' is an absolute path" in r.output
    assert "--allow-outside-root" in r.output and "--image-root" in r.output
    assert not (tmp_path / "s.zarr").exists()

    r = _ingest("parquet", root / "hf.parquet", "--split", "test", "--allow-outside-root",
                "--store", tmp_path / "s.zarr")
    assert r.exit_code == 0, r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    paths = [str(p) for p in store.image_paths()]
    assert paths[0] == "hf.parquet::image.bytes@0"
    assert paths[1] == "sub/b.jpg"  # an absolute path inside the root is stored relative to it
    assert paths[2] == str(outside)
    for row, seed in enumerate((0, 1, 2)):
        want = np.asarray(Image.open(io.BytesIO(_jpeg(seed))).convert("RGB"))
        assert np.array_equal(np.asarray(decode(str(store.image_file(row)))), want)


def test_parquet_symlink_and_dotdot_out_of_root_are_refused(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(_jpeg(3))
    (root / "inside.jpg").write_bytes(_jpeg(4))
    os.symlink(secret, root / "link.jpg")
    for bad, why in (("link.jpg", "leaves the image root"), ("../secret.jpg", "leaves the image root")):
        pq.write_table(pa.table({"path": ["inside.jpg", bad], "caption": ["x", "y"]}), root / "p.parquet")
        r = _ingest("parquet", root / "p.parquet", "--split", "train", "--store", tmp_path / "s.zarr")
        assert r.exit_code == 1, r.output
        assert f"row 1: image path {bad!r} in column 'path' {why}" in r.output
        assert f"resolves to {secret.resolve()}" in r.output
        assert not (tmp_path / "s.zarr").exists()
    r = _ingest("parquet", root / "p.parquet", "--split", "train", "--allow-outside-root",
                "--store", tmp_path / "s.zarr")
    assert r.exit_code == 0, r.output
    assert [str(p) for p in FeatureStore.open(tmp_path / "s.zarr").image_paths()] == ["inside.jpg", "../secret.jpg"]


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("bad", ["../../etc/k2.jpg", "/abs/k2.jpg"])
def test_webdataset_member_leaving_the_shard_is_refused_unless_allowed(tmp_path, bad):
    shards = tmp_path / "wds"
    shards.mkdir()
    with tarfile.open(shards / "s.tar", "w") as tf:
        _add(tf, "k1.jpg", _jpeg(5))
        _add(tf, "k1.txt", b"one")
        _add(tf, bad, _jpeg(6))
        _add(tf, bad.replace(".jpg", ".txt"), b"two")
    with tarfile.open(shards / "s.tar") as tf:
        assert bad in tf.getnames()  # the name is stored as written
    r = _ingest("webdataset", shards / "s.tar", "--split", "train", "--store", tmp_path / "s.zarr")
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert f"member name {bad!r}" in r.output and "--allow-outside-root" in r.output
    assert not (tmp_path / "s.zarr").exists()
    r = _ingest("webdataset", shards / "s.tar", "--split", "train", "--allow-outside-root",
                "--store", tmp_path / "s.zarr")
    assert r.exit_code == 0, r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    assert len(store.image_ids()) == 2
    want = np.asarray(Image.open(io.BytesIO(_jpeg(6))).convert("RGB"))
    assert np.array_equal(np.asarray(decode(str(store.image_file(1)))), want)  # read from the shard


def test_webdataset_symlinked_shard_is_read_at_its_target(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    with tarfile.open(real / "s.tar", "w") as tf:
        _add(tf, "k1.jpg", _jpeg(7))
        _add(tf, "k1.txt", b"one")
    (tmp_path / "links").mkdir()
    os.symlink(real / "s.tar", tmp_path / "links" / "s.tar")
    r = _ingest("webdataset", tmp_path / "links" / "s.tar", "--split", "train", "--store", tmp_path / "s.zarr")
    assert r.exit_code == 0, r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    assert store.image_root == real.resolve()
    assert str(store.image_paths()[0]).startswith("s.tar::k1.jpg@")
