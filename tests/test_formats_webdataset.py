"""`vsekit ingest webdataset`: shards written by webdataset's own TarWriter, images read in place."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from vsekit.cli import main
from vsekit.extract.reader import decode
from vsekit.storage import FeatureStore
from vsekit.storage.sources.shards import is_ref

wds = pytest.importorskip("webdataset")


def _png(rng, side=8) -> tuple[bytes, np.ndarray]:
    pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue(), pixels


def write_shards(folder, n_shards=3, per_shard=5, seed=0):
    """img2dataset's layout: KEY = shard index + sample index; .png/.jpg, .txt, .json per key."""
    rng = np.random.default_rng(seed)
    truth = {}
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        with wds.TarWriter(str(folder / f"shard-{s:04d}.tar")) as sink:
            for i in range(per_shard):
                key = f"{s:04d}{i:05d}"
                data, pixels = _png(rng)
                caption = f"a photo number {s} {i}"
                sample = {"__key__": key, "png": data,
                          "json": json.dumps({"key": key, "caption": caption, "status": "success"}).encode()}
                if i % 2 == 0:
                    sample["txt"] = (caption + "\nsecond  caption here\n").encode()
                sink.write(sample)
                truth[key] = (pixels, [caption, "second caption here"] if i % 2 == 0 else [caption])
    return truth


def test_ingest_brace_pattern_and_read_in_place(tmp_path):
    truth = write_shards(tmp_path / "wds")
    pattern = str(tmp_path / "wds" / "shard-{0000..0002}.tar")
    r = CliRunner().invoke(main, ["ingest", "webdataset", pattern, "--store", str(tmp_path / "s.zarr"),
                                  "--ratios", "0.6,0.2,0.2"])
    assert r.exit_code == 0, r.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    ids = list(store.image_ids())
    assert ids == sorted(truth)  # shard order, then order in the shard
    # independent reading: webdataset's own iterator groups the same keys and captions
    seen = {}
    for sample in wds.WebDataset(pattern, shardshuffle=False):
        caps = (sample["txt"].decode().splitlines() if "txt" in sample
                else [json.loads(sample["json"])["caption"]])
        seen[sample["__key__"]] = [" ".join(c.split()) for c in caps if c.strip()]
    owners, text = store.caption_images(), store.caption_text()
    for row, key in enumerate(ids):
        assert list(text[owners == row]) == seen[key] == truth[key][1]
        path = str(store.image_file(row))
        assert is_ref(path) and ".tar::" in path
        assert np.array_equal(np.asarray(decode(path)), truth[key][0])  # the pixels, unpacked nowhere
    assert not list((tmp_path / "s.zarr").rglob("*.png"))
    from vsekit.report.images import load_thumbnail  # the report shows in-shard images too

    assert np.array_equal(np.asarray(load_thumbnail(store.image_file(0), 64)), truth[ids[0]][0])
    splits = store.image_splits()
    assert sorted(np.bincount(splits, minlength=3)[:3].tolist()) == [3, 3, 9]


def test_changed_shard_is_reported_not_misread(tmp_path):
    write_shards(tmp_path / "wds", n_shards=1, per_shard=3)
    store_path = tmp_path / "s.zarr"
    from vsekit.storage.sources.webdataset import ingest_webdataset

    store, _ = ingest_webdataset([tmp_path / "wds" / "shard-0000.tar"], store_path, split="train")
    # rewrite the shard with different samples: offsets now point elsewhere
    rng = np.random.default_rng(5)
    with wds.TarWriter(str(tmp_path / "wds" / "shard-0000.tar")) as sink:
        sink.write({"__key__": "x", "txt": b"a much longer caption that shifts every offset " * 20,
                    "png": _png(rng)[0]})
        for i in range(3):
            sink.write({"__key__": f"0000{i:05d}", "png": _png(rng, 9)[0], "txt": b"c"})
    from vsekit.extract.images import ImageError

    with pytest.raises(ImageError, match="changed since it was ingested"):
        decode(str(store.image_file(1)))


def test_refusals_and_skips(tmp_path):
    write_shards(tmp_path / "a", n_shards=1)
    write_shards(tmp_path / "b", n_shards=1)  # the same keys again
    run = CliRunner().invoke
    r = run(main, ["ingest", "webdataset", str(tmp_path / "a" / "shard-0000.tar"),
                   str(tmp_path / "b" / "shard-0000.tar"), "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 1 and "keys must be unique" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "s.zarr").exists()
    gz = tmp_path / "c.tar.gz"
    with tarfile.open(gz, "w:gz"):
        pass
    r = run(main, ["ingest", "webdataset", str(gz), "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 1 and "decompress" in r.output
    r = run(main, ["ingest", "webdataset", str(tmp_path / "none-{0..1}.tar"), "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 1 and "none-0.tar: no such shard file" in r.output
    # a sample without a caption is skipped and reported; --strict makes it an error
    rng = np.random.default_rng(1)
    with wds.TarWriter(str(tmp_path / "d.tar")) as sink:
        sink.write({"__key__": "k1", "png": _png(rng)[0], "txt": b"ok caption"})
        sink.write({"__key__": "k2", "png": _png(rng)[0]})
        sink.write({"__key__": "k3", "txt": b"no image"})
    r = run(main, ["ingest", "webdataset", str(tmp_path / "d.tar"), "--split", "test",
                   "--store", str(tmp_path / "d.zarr")])
    assert r.exit_code == 0 and "k2 has no caption" in r.output and "k3 has no image" in r.output
    assert list(FeatureStore.open(tmp_path / "d.zarr").image_ids()) == ["k1"]
    r = run(main, ["ingest", "webdataset", str(tmp_path / "d.tar"), "--strict",
                   "--store", str(tmp_path / "e.zarr")])
    assert r.exit_code == 1 and "--strict" in r.output


def test_an_image_in_a_shard_is_decoded_as_the_same_file_unpacked(tmp_path):
    """The crop kinds decode an in-shard image exactly as the file (libjpeg-turbo, and DCT scaling
    under turbo), so a set's pixels do not depend on whether its images were unpacked."""
    from vsekit.extract.images import decode_crops, image_crops, load_ref_image
    from vsekit.extract.plan import make_plan
    from vsekit.storage.sources.webdataset import ingest_webdataset

    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:150, 0:200]
    files = {}
    with wds.TarWriter(str(tmp_path / "s.tar")) as sink:
        for i, fmt in enumerate(("jpg", "jpg", "png")):   # 200x150: over twice a resize of 40 (53x40)
            a = np.clip(np.stack([x + 20 * i, y, x + y], -1) * 0.6 + rng.normal(0, 10, (150, 200, 3)), 0, 255)
            buf = io.BytesIO()
            Image.fromarray(a.astype(np.uint8)).save(buf, format="JPEG" if fmt == "jpg" else "PNG", quality=90)
            files[f"k{i}"] = tmp_path / f"k{i}.{fmt}"
            files[f"k{i}"].write_bytes(buf.getvalue())
            sink.write({"__key__": f"k{i}", fmt: buf.getvalue(), "txt": b"a caption"})
    store, _ = ingest_webdataset([tmp_path / "s.tar"], tmp_path / "s.zarr", split="train")
    for decoder in ("turbo", "torchvision", "pil"):
        plan = make_plan("test_resnet", "global", weights="none", input_size=32, resize=40, crops=10,
                         decoder=decoder)
        for row, key in enumerate(store.image_ids()):
            ref = str(store.image_file(row))
            assert is_ref(ref)
            want = decode_crops(files[key], 40, 32, 10, decoder=decoder)
            assert np.array_equal(decode(ref, plan), want), (decoder, key)
            if decoder == "turbo" and key != "k2":   # the JPEGs: DCT scaling, which a full decode lacks
                assert not np.array_equal(want, image_crops(load_ref_image(ref), 40, 32, 10, decoder="turbo"))
