"""Images on object storage (issue 46) through the readers beside extraction's CPU decoders:
``--decoder nvjpeg`` (the JPEG bytes fetched by the batch's ranged GETs, decoded by the driving
process) and ``report-boxes`` (fetched with the command's --image-option). Each against the same
images on disk, on a local S3 server (moto)."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

pytest.importorskip("obstore")
pytest.importorskip("moto")
pytest.importorskip("torchvision")
pytestmark = pytest.mark.e2e   # ingests and extracts through the CLI

from test_images_remote import EXTRACT, FaultyProxy, counted, upload  # noqa: E402,F401 - counted: a fixture

from vsekit.cli import main  # noqa: E402
from vsekit.extract import extract, gpu_decode  # noqa: E402
from vsekit.extract.regions import region_arrays  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402


@pytest.fixture()
def jpeg_shards(s3, demo_dir, tmp_path, counted):
    """The demo's JPEGs as two webdataset shards (KEY.jpg, KEY.txt) on disk and on S3, each ingested
    (both stores on disk); the JPEG files' bytes by image id."""
    jpgs = sorted((demo_dir / "images").glob("*.jpg"))
    (tmp_path / "wds").mkdir()
    for s, part in enumerate((jpgs[:12], jpgs[12:])):
        with tarfile.open(tmp_path / "wds" / f"shard-{s}.tar", "w") as tf:
            for jpg in part:
                for name, data in ((f"{jpg.stem}.jpg", jpg.read_bytes()), (f"{jpg.stem}.txt", b"a picture")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    upload(s3, tmp_path / "wds", "wds")
    stores = {"disk": tmp_path / "disk.zarr", "s3": tmp_path / "s3.zarr"}
    for where, src in (("disk", str(tmp_path / "wds" / "shard-{0..1}.tar")), ("s3", f"s3://{s3.bucket}/wds/shard-{{0..1}}.tar")):
        r = CliRunner().invoke(main, ["ingest", "webdataset", src, "--store", str(stores[where]), "--split", "train"])
        assert r.exit_code == 0, r.output
    return stores, {jpg.stem: jpg.read_bytes() for jpg in jpgs}


def test_nvjpeg_gets_the_jpeg_bytes_of_shards_on_s3_by_ranged_gets_and_gives_the_features_of_disk(
        s3, jpeg_shards, counted, monkeypatch):
    """The bytes that reach the batched decode are the JPEG files' own, fetched with a few ranged GETs
    (not a GET an image); on the CPU, where ``decode_jpeg`` is libjpeg-turbo,
    the features equal the torchvision decoder's from disk. CUDA's check is lifted for it."""
    stores, jpegs = jpeg_shards
    seen: dict[str, dict[int, bytes]] = {"disk": {}, "s3": {}}
    real = gpu_decode._decode_all

    def recorded(items, device):   # the driving process's batched decode, its input kept
        seen[where].update({it.row: it.encoded.data.tobytes() for it in items})
        return real(items, device)

    monkeypatch.setattr(gpu_decode, "_decode_all", recorded)
    monkeypatch.setattr(gpu_decode, "check_device", lambda device: None)
    kw = {**EXTRACT, "batch_size": 8, "block_rows": 24}
    ref = extract(str(stores["disk"]), name="tv", decoder="torchvision", workers=0, **kw)
    proxy = FaultyProxy(s3.endpoint, kind="/wds/")   # the images' GETs, counted at the server
    counted.use_options({"endpoint": proxy.url})
    for where in ("disk", "s3"):   # in-process (decoding processes: the same items, pickled; slow to start here)
        got = extract(str(stores[where]), name="nv", decoder="nvjpeg", workers=0, **kw)
        assert got.failed == ref.failed == 0, got.errors
    proxy.server.shutdown()
    ids = FeatureStore.open(stores["s3"]).image_ids()
    assert seen["s3"] == seen["disk"] == {row: jpegs[i] for row, i in enumerate(ids)}   # every image, its file's bytes
    assert 0 < proxy.gets <= 2 * 3 < len(ids)   # 24 images, 2 shards, batches of 8: a ranged GET a batch's shard
    want = FeatureStore.open(stores["disk"]).features("tv").data[:]
    for where in ("disk", "s3"):
        fs = FeatureStore.open(stores[where]).features("nv")
        assert fs.attrs["decoder"] == "nvjpeg" and np.array_equal(fs.data[:], want), where


def _regions(store_path, rows: int) -> None:
    """A regions set "reg" in the store: two boxes a row, their label indices."""
    store = FeatureStore.open(store_path, mode="r+")

    class P:   # the plan fields region_arrays reads
        max_regions, detector = 2, "butd-r101"

    fs = store.create_features("reg", (2, 4), np.float16, attrs={"kind": "regions"}, block_rows=rows,
                               extra=region_arrays(P))
    boxes = np.tile(np.array([[4, 6, 40, 30], [20, 18, 60, 58]], np.float32), (rows, 1, 1))
    fs.write_block(0, np.ones((rows, 2, 4), np.float16), boxes=boxes, count=np.full(rows, 2, np.int16),
                   labels=np.tile(np.array([1, 0], np.int16), (rows, 1)),
                   attrs=np.tile(np.array([0, 2], np.int16), (rows, 1)))


def test_report_boxes_draws_over_images_on_s3_as_over_the_same_images_on_disk(s3, demo_dir, tmp_path, counted):
    """An image root on S3 behind a server reached only through ``--image-option endpoint=...``: the
    PNGs' pixels equal the disk store's, each image one GET."""
    upload(s3, demo_dir / "images", "demo/images")
    rels = sorted(p.name for p in (demo_dir / "images").glob("*.jpg"))
    table = tmp_path / "captions.tsv"
    table.write_text("".join(f"{r}\ta picture of {r}\n" for r in rels))
    proxy = FaultyProxy(s3.endpoint, kind="/demo/images/")
    more = {"disk": [], "s3": ["--image-option", f"endpoint={proxy.url}"]}
    for where, root in (("disk", str(demo_dir / "images")), ("s3", f"s3://{s3.bucket}/demo/images")):
        store = tmp_path / f"{where}.zarr"
        r = CliRunner().invoke(main, ["ingest", "folder", root, str(table), "--store", str(store)])
        assert r.exit_code == 0, r.output
        _regions(store, FeatureStore.open(store).n_images)
        r = CliRunner().invoke(main, ["report-boxes", str(store), "reg", "--rows", "0,5", "--out",
                                      str(tmp_path / f"png-{where}"), *more[where]])
        assert r.exit_code == 0, r.output
    proxy.server.shutdown()
    assert proxy.gets == 2
    for png in ("reg_0.png", "reg_5.png"):
        a, b = (np.asarray(Image.open(tmp_path / f"png-{w}" / png)) for w in ("disk", "s3"))
        assert a.shape == (64, 64, 3) and np.array_equal(a, b), png


@pytest.mark.slow   # extracts twice and trains (minutes on a loaded 2-core machine)
def test_report_shows_thumbnails_of_images_on_s3_as_of_the_same_images_on_disk(s3, demo_dir, tmp_path, counted):
    """`vsekit report` of one run over two stores, the images of one on S3 behind a server reached only
    through ``--image-option endpoint=...``: the same page, thumbnails included, but for the image root."""
    upload(s3, demo_dir / "images", "demo/images")
    fast = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--crops", "1", "--input-size", "32",
            "--resize", "36", "--batch-size", "8", "--block-rows", "8", "--workers", "0", "--no-progress"]
    roots = {"disk": str(demo_dir), "s3": f"s3://{s3.bucket}/demo"}
    for where, root in roots.items():
        store = str(tmp_path / f"{where}.zarr")
        for args in (["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--image-root", root],
                     ["extract", *fast], ["tokenize", "--min-count", "1"]):
            r = CliRunner().invoke(main, [*args, "--store", store])
            assert r.exit_code == 0, (args, r.output)
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--store", str(tmp_path / "disk.zarr"), "--out", str(run), "--features",
                                  "test_resnet_fne", "--model", "vse", "--preset", "demo", "--embed-dim", "16",
                                  "--word-dim", "8", "--batch-size", "8", "--epochs", "1", "--no-progress",
                                  "--device", "cpu"])
    assert r.exit_code == 0, r.output
    proxy = FaultyProxy(s3.endpoint, kind="/demo/images/")
    more = {"disk": [], "s3": ["--image-option", f"endpoint={proxy.url}"]}
    pages = {}
    for where in roots:
        out = tmp_path / f"report-{where}"
        r = CliRunner().invoke(main, ["report", str(run), "--out", str(out), "--store", str(tmp_path / f"{where}.zarr"),
                                      "--device", "cpu", "--attention", "0", *more[where]])
        assert r.exit_code == 0, r.output
        pages[where] = (out / "index.html").read_text().replace(f"{where}.zarr", "STORE")
    proxy.server.shutdown()
    assert proxy.gets > 0 and pages["s3"].count("data:image/jpeg;base64,") > 0
    assert pages["s3"].replace(roots["s3"], "ROOT") == pages["disk"].replace(roots["disk"], "ROOT")
