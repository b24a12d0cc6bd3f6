"""Images that fail during extract (bad boxes, missing files, a failure before the first row,
Ctrl-C with decoding workers): each failure is recorded per row with its reason, survives a resume,
and the retry paths (`--retry-failed`, a rerun with other options) work."""

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

from vsekit.cli import main
from vsekit.storage import FeatureStore

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from vsekit.extract import extract  # noqa: E402
from vsekit.storage import integrity  # noqa: E402

KW = dict(weights="none", input_size=32, resize=36, batch_size=4, block_rows=4, workers=0, progress=False)



# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _raw(fs) -> dict:
    return {k: np.asarray(fs.group[k][:]).tobytes() for k in sorted(fs.group.array_keys())}


def test_nan_inf_and_empty_boxes_mark_the_image_failed_and_reasons_survive_a_resume(demo_store, tmp_path):
    ids = [str(i) for i in demo_store.image_ids()]
    boxes = {i: [[2, 2, 30, 30], [10, 5, 40, 50]] for i in ids}
    boxes[ids[0]] = [[2, 2, 30, 30], [float("nan"), 1, 20, 20]]
    boxes[ids[5]] = [[0, 0, float("inf"), 10]]
    boxes[ids[9]] = []
    bf = tmp_path / "boxes.json"
    bf.write_text(json.dumps(boxes))   # Python's json writes (and reads) NaN and Infinity
    code = (f"from vsekit.extract import extract; extract({str(demo_store.path)!r}, 'test_resnet', 'regions', "
            f"boxes={str(bf)!r}, max_regions=4, weights='none', input_size=32, batch_size=4, block_rows=4, "
            f"workers=0, progress=False, dtype='float32')")
    src = str(Path(__file__).resolve().parents[1] / "src")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr       # a NaN box used to segfault inside roi_align
    fs = FeatureStore.open(demo_store.path).features("test_resnet_regions")
    status, errors = np.asarray(fs.status[:]), fs.errors()
    assert list(np.flatnonzero(status == 2)) == [0, 5, 9]
    assert "box 1" in errors[0] and "not finite" in errors[0] and "not finite" in errors[5]
    assert "empty" in errors[9]
    assert np.all(np.isfinite(np.asarray(fs.data[:], np.float32)))
    # a resume (after a repair of block 2) keeps the reasons recorded by the first run
    f = integrity._chunk_file(fs, "data", 2)
    f.unlink()
    extract(demo_store, "test_resnet", "regions", boxes=str(bf), max_regions=4, dtype="float32",
            **{k: v for k, v in KW.items() if k != "resize"})
    fs = FeatureStore.open(demo_store.path).features("test_resnet_regions")
    assert set(fs.errors()) == {0, 5, 9}


# issue 15: the extract rerun paths ----------------------------------------------------------------
def test_extract_failing_before_first_image_leaves_no_set_and_the_retry_works(demo_store, tmp_path):
    bad = tmp_path / "w.pt"
    bad.write_bytes(b"not a checkpoint")
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                  "--weights", str(bad), "--input-size", "32", "--resize", "36",
                                  "--workers", "0", "--no-progress"])
    assert r.exit_code != 0
    assert not FeatureStore.open(demo_store.path).has_features("test_resnet_global")
    r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                  "--weights", "none", "--input-size", "32", "--resize", "36",
                                  "--workers", "0", "--no-progress"])
    assert r.exit_code == 0, r.output


def test_retry_failed_retries_missing_files_and_messages_give_the_command(demo_store, tmp_path):
    img = demo_store.image_file(3)
    aside = tmp_path / "aside.jpg"
    shutil.move(img, aside)
    try:
        extract(demo_store, "test_resnet", "global", name="g", **KW)
        fs = FeatureStore.open(demo_store.path).features("g")
        assert fs.counts()["failed"] == 1
        r = CliRunner().invoke(main, ["export", "vsepp", "--store", str(demo_store.path), "--features", "g",
                                      "--out", str(tmp_path / "out")])
        # one short line (issue 34): the two ways out, and where the exact retry command is
        assert r.exit_code == 1 and "--drop-failed" in r.output and f"vsekit info {demo_store.path} g" in r.output
        info = CliRunner().invoke(main, ["info", str(demo_store.path), "g"])
        assert "--retry-failed" in info.output and "vsekit extract --store" in info.output
        again = extract(demo_store, "test_resnet", "global", name="g", **KW)   # without the flag: kept failed
        assert again.failed == 1 and again.blocks_run == 0
    finally:
        shutil.move(aside, img)
    again = extract(demo_store, "test_resnet", "global", name="g", retry_failed=True, **KW)
    fs = FeatureStore.open(demo_store.path).features("g")
    assert again.failed == 0 and fs.counts()["done"] == fs.n_rows and fs.errors() == {}
    ref = extract(demo_store, "test_resnet", "global", name="ref", **KW)
    assert ref.failed == 0
    np.testing.assert_array_equal(fs.data[:], FeatureStore.open(demo_store.path).features("ref").data[:])


@pytest.mark.slow
def test_ctrl_c_with_decoding_workers_exits_and_says_what_was_kept(demo_store, tmp_path):
    flag = tmp_path / "go"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", "VSEKIT_PAUSE": "extract:batch@3",
           "VSEKIT_PAUSE_FILE": str(flag)}
    cmd = [sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())", "extract",
           "--store", str(demo_store.path), "--model", "test_resnet", "--weights", "none", "--input-size", "32",
           "--resize", "36", "--batch-size", "4", "--block-rows", "4", "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    status = demo_store.path / "features" / "test_resnet_global"
    deadline = time.monotonic() + 240
    while True:   # block 0 done in the store, and the run held at its third batch
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        if Path(f"{flag}.reached").exists() and status.exists():
            fs = FeatureStore.open(demo_store.path).features("test_resnet_global")
            if fs.counts()["done"] >= 4:
                break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C does: the whole process group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: kept" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err
