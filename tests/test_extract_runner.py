"""The extraction runner through the CLI: bad inputs, --strict, resume after SIGKILL, overwrite,
a crashing decoder process, grids and regions."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

torch = pytest.importorskip("torch")

from vsekit.cli import main  # noqa: E402
from vsekit.extract import extract  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

torch.set_num_threads(1)
FAST = ["--model", "test_resnet", "--weights", "none", "--input-size", "48", "--resize", "56",
        "--batch-size", "4", "--block-rows", "4", "--no-progress"]


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _store_of(tmp_path: Path, files: dict[str, Path | bytes | Image.Image]) -> FeatureStore:
    """A store whose images are ``files`` (copied, written or saved under tmp_path/img)."""
    root = tmp_path / "img"
    root.mkdir()
    for name, src in files.items():
        if isinstance(src, Image.Image):
            src.save(root / name)
        elif isinstance(src, bytes):
            (root / name).write_bytes(src)
        elif src is not None:
            shutil.copy(src, root / name)
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t", image_root=root)
    store.write_images([f"i{k}" for k in range(len(files))], list(files), ["train"] * len(files))
    return store


def test_bad_inputs_are_marked_failed_and_listed(tmp_path, demo_dir):
    demo = sorted((demo_dir / "images").glob("*.jpg"))
    rgb = Image.open(demo[0]).convert("RGB")
    good = (demo_dir / "images" / demo[1].name).read_bytes()
    files = {
        "ok0.jpg": demo[0], "zero.jpg": b"", "text.jpg": b"hello, I am text",
        "trunc.jpg": good[: len(good) // 3], "missing.jpg": None, "gray.png": rgb.convert("L"),
        "cmyk.jpg": rgb.convert("CMYK"), "pal.png": rgb.quantize(8), "alpha.png": rgb.convert("RGBA"),
        "g16.png": Image.fromarray(np.asarray(rgb.convert("L"), np.uint16) * 257), "ok1.jpg": demo[1],
        "big.png": Image.new("RGB", (300, 200), (9, 9, 9)),
    }
    store = _store_of(tmp_path, files)
    r = CliRunner().invoke(main, ["extract", "--store", str(store.path), "--kind", "global", *FAST,
                                  "--workers", "0"])
    assert r.exit_code == 0, r.output
    fs = FeatureStore.open(store.path).features("test_resnet_global")
    status = fs.status[:]
    names = list(files)
    failed = {names[i] for i in np.flatnonzero(status == 2)}
    assert failed == {"zero.jpg", "text.jpg", "trunc.jpg", "missing.jpg"}
    assert (status != 0).all()
    errors = fs.errors()
    assert "zero-byte" in errors[names.index("zero.jpg")]
    assert "missing file" in errors[names.index("missing.jpg")]
    assert "4 failed" in r.output and "row 1:" in r.output and "zero.jpg" in r.output
    data = fs.data[:]
    assert not data[status == 2].any() and np.abs(data[status == 1]).sum(axis=1).min() > 0
    # gray / 16-bit gray of the same picture give the same features
    assert np.array_equal(data[names.index("gray.png")], data[names.index("g16.png")])


def test_decompression_bomb_is_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40 * 40)
    store = _store_of(tmp_path, {"small.png": Image.new("RGB", (40, 30)), "bomb.png": Image.new("RGB", (90, 90))})
    res = extract(store, "test_resnet", "global", weights="none", input_size=16, resize=20, workers=0,
                  progress=False)
    assert res.failed == 1 and "decompression-bomb" in res.errors[1]


def test_strict_stops_at_first_bad_image(tmp_path, demo_dir):
    demo = sorted((demo_dir / "images").glob("*.jpg"))
    store = _store_of(tmp_path, {"a.jpg": demo[0], "b.jpg": b"junk", "c.jpg": demo[1]})
    r = CliRunner().invoke(main, ["extract", "--store", str(store.path), *FAST, "--strict", "--workers", "0"])
    assert r.exit_code == 1
    assert "row 1" in r.output and "b.jpg" in r.output and "--strict" in r.output
    # nothing of the bad block was written, and a run that ends before any row is done leaves no set
    assert not FeatureStore.open(store.path).has_features("test_resnet_global")


def test_crashing_decoder_process_does_not_end_the_run(demo_store, monkeypatch):
    import vsekit.extract.reader as reader

    bad = str(demo_store.image_file(5))
    real = reader.decode

    def crashing(path, *plan):
        if path == bad:
            os._exit(3)  # like a segfault in a codec: the worker process dies
        return real(path, *plan)

    ref = extract(demo_store, "test_resnet", "global", weights="none", input_size=32, resize=36,
                  workers=0, batch_size=4, block_rows=8, name="ref", progress=False)
    monkeypatch.setattr(reader, "decode", crashing)
    res = extract(demo_store, "test_resnet", "global", weights="none", input_size=32, resize=36,
                  workers=2, batch_size=4, block_rows=8, name="crash", progress=False)
    assert res.failed == 1 and "crashed its worker process" in res.errors[5]
    a, b = demo_store.features("ref").data[:], demo_store.features("crash").data[:]
    keep = np.arange(len(a)) != 5
    assert np.array_equal(a[keep], b[keep])
    assert ref.done == len(a)


def _done_rows(store, name):
    try:
        return int((FeatureStore.open(store.path).features(name).status[:] != 0).sum())
    except Exception:  # the set is being created by the other process
        return None


@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted_run(demo_store, tmp_path):
    args = ["--store", str(demo_store.path), "--kind", "fne", "--crops", "5", "--batch-size", "2",
            "--block-rows", "2", "--model", "test_resnet", "--weights", "none", "--input-size", "48",
            "--resize", "56", "--workers", "0", "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-c", "from vsekit.cli import main; main()", "extract", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    name, n = "test_resnet_fne", demo_store.n_images
    deadline = time.time() + 120
    killed = False
    while time.time() < deadline and proc.poll() is None:
        done = _done_rows(demo_store, name)
        if done is not None and 4 <= done < n - 4:
            if True:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
        time.sleep(0.02)
    proc.wait(30)
    assert killed, proc.stdout.read().decode()
    fs = FeatureStore.open(demo_store.path).features(name)
    partial = fs.counts()
    assert 0 < partial["done"] < n and partial["pending"] > 0
    r = CliRunner().invoke(main, ["extract", *args])
    assert r.exit_code == 0, r.output
    assert f"{n} done" in r.output and "skipped" in r.output
    skipped = int(r.output.split("skipped ")[1].split()[0])
    assert skipped >= partial["done"] // 2
    resumed = FeatureStore.open(demo_store.path).features(name).data[:]
    # an uninterrupted run into another set
    r = CliRunner().invoke(main, ["extract", *args, "--name", "whole"])
    assert r.exit_code == 0, r.output
    assert np.array_equal(resumed, FeatureStore.open(demo_store.path).features("whole").data[:])


def test_changed_settings_need_overwrite(demo_store):
    base = ["extract", "--store", str(demo_store.path), *FAST, "--workers", "0"]
    assert CliRunner().invoke(main, base).exit_code == 0
    r = CliRunner().invoke(main, [*base, "--crops", "5"])
    assert r.exit_code == 1 and "--overwrite" in r.output
    r = CliRunner().invoke(main, [*base, "--crops", "5", "--overwrite"])
    assert r.exit_code == 0, r.output
    fs = FeatureStore.open(demo_store.path).features("test_resnet_global")
    assert fs.attrs["crops"] == 5 and fs.attrs["weights"] == "none"
    assert fs.attrs["crop_size"] == 48 and fs.attrs["resize"] == 56 and fs.attrs["mean"] == [0.5] * 3
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "nonet", "--weights", "none"])
    assert r.exit_code == 1 and "valid choices" in r.output


def test_grid_and_regions_from_boxes_file(demo_store, demo_dir, tmp_path):
    common = ["--store", str(demo_store.path), "--model", "test_resnet", "--weights", "none",
              "--input-size", "64", "--workers", "0", "--no-progress", "--block-rows", "8"]
    r = CliRunner().invoke(main, ["extract", *common, "--kind", "grid", "--grid", "2"])
    assert r.exit_code == 0, r.output
    g = FeatureStore.open(demo_store.path).features("test_resnet_grid")
    assert g.shape == (demo_store.n_images, 2, 2, 96) and g.data.dtype == np.float16
    # the stored grid is the 2x2 average pool of the last map (64px input → 2x2 map: identity)
    boxes = json.loads((demo_dir / "boxes.json").read_text())
    ids = list(demo_store.image_ids())
    del boxes[ids[3]]  # an image without an entry fails with a reason
    bfile = tmp_path / "boxes.json"
    bfile.write_text(json.dumps(boxes))
    r = CliRunner().invoke(main, ["extract", *common, "--kind", "regions", "--boxes", str(bfile),
                                  "--max-regions", "4"])
    assert r.exit_code == 0, r.output
    fs = FeatureStore.open(demo_store.path).features("test_resnet_regions")
    assert fs.shape == (demo_store.n_images, 4, 96)
    count, stored = fs.array("count")[:], fs.array("boxes")[:]
    assert fs.status[3] == 2 and "no boxes for image id" in fs.errors()[3]
    for row, i in enumerate(ids):
        if row == 3:
            continue
        want = np.asarray(boxes[i], np.float32)
        assert count[row] == len(want)
        np.testing.assert_allclose(stored[row, :len(want)], want, rtol=1e-5, atol=1e-3)
        data = fs.data[row].astype(np.float32)
        assert np.abs(data[:len(want)]).sum(axis=1).min() > 0 and not data[len(want):].any()


def test_regions_from_the_detector(tmp_path):
    rng = np.random.default_rng(0)
    imgs = {f"{k}.png": Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)) for k in range(2)}
    store = _store_of(tmp_path, imgs)
    res = extract(store, "test_resnet", "regions", weights="none", boxes="detector", input_size=64,
                  max_regions=6, min_regions=3, workers=0, progress=False, detector_weights="none")
    assert res.done == 2, res.summary()
    fs = store.features(res.name)
    assert fs.attrs["boxes"] == "detector" and fs.shape == (2, 6, 96)
    count, boxes, data = fs.array("count")[:], fs.array("boxes")[:], fs.data[:].astype(np.float32)
    for row in range(2):
        k = int(count[row])
        assert 3 <= k <= 6
        b = boxes[row, :k]  # original pixels of the 80x60 image
        assert (b[:, 0] >= 0).all() and (b[:, 2] <= 80 + 1e-3).all() and (b[:, 3] <= 60 + 1e-3).all()
        assert (b[:, 2] > b[:, 0]).all() and not boxes[row, k:].any() and not data[row, k:].any()


class _Bar:
    """Records what the extraction's progress bar is told (issue 34: it jumped from 0 to 100%)."""

    seen: list = []

    def __init__(self, *a, total=None, disable=False, **k):
        self.total = total
        _Bar.seen = [("total", total)]

    def set_postfix_str(self, text, refresh=True):
        if text:
            _Bar.seen.append(("says", text))

    def update(self, n):
        _Bar.seen.append(("update", n))

    def close(self):
        pass


def test_the_progress_bar_moves_per_batch_and_says_what_a_single_batch_does(tmp_path, demo_dir, monkeypatch):
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    demo = sorted((demo_dir / "images").glob("*.jpg"))
    store = _store_of(tmp_path, {f"{i}.jpg": demo[i] for i in range(3)})
    # smaller than a batch: one batch in all; the bar says it is decoding, then running the model
    extract(store, "test_resnet", "global", weights="none", input_size=16, resize=20, workers=0, batch_size=8,
            name="one", progress=True)
    assert _Bar.seen == [("total", 3), ("says", "decoding 3 images"), ("says", "model on 3 images"), ("update", 3)]
    # one block of two batches: the bar moves per batch, not once per block
    extract(store, "test_resnet", "global", weights="none", input_size=16, resize=20, workers=0, batch_size=2,
            block_rows=4, name="two", progress=True)
    assert [e for e in _Bar.seen if e[0] == "update"] == [("update", 2), ("update", 1)]


def test_a_run_that_leaves_rows_pending_exits_1_in_one_line_and_keeps_its_finished_blocks(demo_store, monkeypatch):
    """Issue 44 item 4: a run whose blocks were not all committed (here block 1 is refused, as when
    another writer's record was found) used to print "... 4 pending of 24 rows" and exit 0. It exits 1
    with one Error line; what it committed stays, and the rerun computes the rest."""
    from vsekit.extract import runner

    real = runner.commit

    def refuse_block_1(fs, buf, guard):
        return "another writer committed it first" if buf.block.index == 1 else real(fs, buf, guard)

    monkeypatch.setattr(runner, "commit", refuse_block_1)
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), *FAST, "--workers", "0"])
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1, r.output
    n = demo_store.n_images
    assert f"4 of {n} rows are still pending after this run" in errors[0] and "rerun the same command" in errors[0]
    status = FeatureStore.open(demo_store.path).features("test_resnet_global").status[:]
    assert np.all(status[4:8] == 0) and np.all(status[:4] != 0) and np.all(status[8:] != 0)   # on disk
    monkeypatch.setattr(runner, "commit", real)
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), *FAST, "--workers", "0"])
    assert r.exit_code == 0 and f"0 pending of {n} rows" in r.output and "ran 1 block" in r.output, r.output
