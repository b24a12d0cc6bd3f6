"""Damaged stores and hostile inputs (issue 19), and the extract rerun paths of issue 15.

Damage is made by hand (a deleted, truncated or altered chunk file); each test checks that it is
detected, reported with the command that repairs it, and that the repair ends with the same bytes
as an undamaged run.
"""

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
from vsekit.storage.sources.common import IngestError

torch = pytest.importorskip("torch")
torch.set_num_threads(1)

from vsekit.extract import extract  # noqa: E402
from vsekit.storage import integrity  # noqa: E402

KW = dict(weights="none", input_size=32, resize=36, batch_size=4, block_rows=4, workers=0, progress=False)


def _raw(fs) -> dict:
    return {k: np.asarray(fs.group[k][:]).tobytes() for k in sorted(fs.group.array_keys())}


@pytest.fixture()
def extracted(demo_store, tmp_path):
    """A finished extraction and a byte copy of the store made before any damage."""
    extract(demo_store, "test_resnet", "global", name="g", **KW)
    ref = tmp_path / "ref.zarr"
    shutil.copytree(demo_store.path, ref)
    return demo_store.path, _raw(FeatureStore.open(ref).features("g"))


def _chunk(path: Path, name: str, array: str, index: int) -> Path:
    fs = FeatureStore.open(path).features(name)
    return integrity._chunk_file(fs, array, index)


def test_deleted_data_chunk_is_detected_refused_by_train_and_reextracted(extracted):
    from vsekit.train.data import open_features

    path, ref = extracted
    _chunk(path, "g", "data", 2).unlink()
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify"])
    assert r.exit_code == 1 and "block 2: data chunk file missing" in r.output
    assert f"vsekit info {path} g --verify --repair" in r.output
    store = FeatureStore.open(path)
    with pytest.raises(Exception, match=r"(?s)damaged.*vsekit info .* --verify --repair.*vsekit extract --store"):
        open_features(store, "g", np.arange(store.n_images))
    extract(path, "test_resnet", "global", name="g", **KW)   # the rerun re-extracts block 2 only
    assert _raw(FeatureStore.open(path).features("g")) == ref
    assert CliRunner().invoke(main, ["info", str(path), "g", "--verify"]).exit_code == 0


def test_truncated_status_chunk_is_a_clear_error_and_repairable(extracted):
    path, ref = extracted
    f = _chunk(path, "g", "status", 1)
    f.write_bytes(f.read_bytes()[:3])
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 0 and "DAMAGED: status unreadable" in r.output and r.exception is None
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify"])
    assert r.exit_code == 1 and "block 1: status chunk unreadable" in r.output
    res = extract(path, "test_resnet", "global", name="g", **KW)
    assert res.blocks_run == 1
    assert _raw(FeatureStore.open(path).features("g")) == ref


def test_altered_bytes_need_the_full_check_then_repair(extracted):
    path, ref = extracted
    f = _chunk(path, "g", "data", 3)
    b = bytearray(f.read_bytes())
    b[100] ^= 0xFF
    f.write_bytes(bytes(b))
    fs = FeatureStore.open(path).features("g")
    assert integrity.verify(fs, quick=True).ok               # same size: only the CRC sees it
    r = CliRunner().invoke(main, ["info", str(path), "g", "--verify", "--repair"])
    assert "block 3: data chunk file's CRC-32" in r.output and "marked pending" in r.output
    assert "vsekit extract --store" in r.output and "--name g" in r.output
    assert FeatureStore.open(path).features("g").counts()["pending"] == 4
    extract(path, "test_resnet", "global", name="g", **KW)
    assert _raw(FeatureStore.open(path).features("g")) == ref


def test_repair_command_in_the_message_rebuilds_the_same_config(extracted):
    """The extract command quoted by the repair message resumes the set (same config hash)."""
    from vsekit.storage.remake import remake_command

    path, ref = extracted
    cmd = remake_command(FeatureStore.open(path), "g")
    args = cmd.split()[1:] + ["--no-progress", "--workers", "0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "ran 0 blocks, skipped 6 already done" in r.output


# boxes ---------------------------------------------------------------------------------------------
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
        assert r.exit_code == 1 and "--retry-failed" in r.output and "vsekit extract --store" in r.output
        info = CliRunner().invoke(main, ["info", str(demo_store.path), "g"])
        assert "--retry-failed" in info.output
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


# ingest: hostile files --------------------------------------------------------------------------------
def _karpathy(tmp_path: Path, records: list) -> Path:
    p = tmp_path / "k.json"
    p.write_text(json.dumps({"images": records}))
    return p


@pytest.mark.parametrize("field,value", [("filename", 7), ("filepath", None), ("sentences", 3), ("split", 1)])
def test_malformed_karpathy_types_name_file_index_and_field(tmp_path, field, value):
    (tmp_path / "a.jpg").write_bytes(b"x")
    good = {"filename": "a.jpg", "split": "train", "sentences": [{"raw": "a cat"}], "imgid": 0}
    bad = {**good, "imgid": 1, field: value}
    p = _karpathy(tmp_path, [good, bad])
    r = CliRunner().invoke(main, ["ingest", "karpathy", str(p), "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 1 and r.exception.__class__ is SystemExit, r.output
    assert f"{p}: images[1]: field '{field}'" in r.output


def test_paths_outside_the_image_root_are_refused_unless_allowed(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "in.jpg").write_bytes(b"x")
    secret = tmp_path / "secret.jpg"
    secret.write_bytes(b"x")
    (root / "link.jpg").symlink_to(secret)
    for k, rel in enumerate(("../secret.jpg", str(secret), "link.jpg")):
        rec = [{"filename": "in.jpg", "split": "train", "imgid": 0},
               {"filename": rel, "split": "train", "imgid": 1}]
        p = _karpathy(tmp_path, rec)
        store = tmp_path / f"s{k}.zarr"
        r = CliRunner().invoke(main, ["ingest", "karpathy", str(p), "--image-root", str(root), "--store", str(store)])
        assert r.exit_code == 1 and "images[1]" in r.output
        assert ("outside the image root" in r.output or "absolute" in r.output), r.output
        assert "--allow-outside-root" in r.output and not store.exists()
        r = CliRunner().invoke(main, ["ingest", "karpathy", str(p), "--image-root", str(root), "--store", str(store),
                                      "--allow-outside-root"])
        assert r.exit_code == 0, r.output
    tsv = tmp_path / "c.tsv"
    tsv.write_text("in.jpg\ta cat\n../secret.jpg\ta secret\n")
    r = CliRunner().invoke(main, ["ingest", "folder", str(root), str(tsv), "--store", str(tmp_path / "f.zarr")])
    assert r.exit_code == 1 and f"{tsv}:2" in r.output and "outside the image root" in r.output


def test_wrong_image_root_names_the_path_it_looked_for(demo_dir, tmp_path):
    r = CliRunner().invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"),
                                  "--image-root", str(tmp_path), "--store", str(tmp_path / "s.zarr")])
    assert r.exit_code == 1
    assert f"looked for e.g. {tmp_path}" in r.output and "check --image-root" in r.output


def test_killed_ingest_leftover_is_removed_but_a_live_one_is_kept(demo_dir, tmp_path):
    from vsekit.storage.lock import acquire

    target = tmp_path / "s.zarr"
    src = str(Path(__file__).resolve().parents[1] / "src")
    r = subprocess.run([sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())",
                        "ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", str(target)],
                       env={**os.environ, "PYTHONPATH": src, "VSEKIT_FAULT": "ingest:rename"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 137
    dead = [p for p in tmp_path.iterdir() if p.name.startswith(".s.zarr.partial-")]
    assert len(dead) == 1 and not target.exists()
    live = tmp_path / ".s.zarr.partial-live"
    live.mkdir()
    acquire(live, "ingest", "vsekit ingest")            # held by this (live) process
    r = CliRunner().invoke(main, ["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", str(target)])
    assert r.exit_code == 0, r.output
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".s.zarr"))
    assert left == [".s.zarr.partial-live"]
