"""Failed rows are a first-class state (issue 34): `info` lists them with their reasons, their splits
and the two ways out; train and evaluate skip them and say how many; a validation split without a
usable image is refused before training with what to do, a small one gets a warning; `train
--val-split` chooses the validation rows.

Each test fails on the code before the issue: `info` gave only a retry command, train and evaluate
skipped failed rows silently, an empty val split was "no images with done features" (what, not what
to do), 1 validation image gave "val rsum 600.0" without a word, and train had no --val-split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage.store import DONE, FAILED, FeatureStore

N = 14


def _store(tmp_path: Path, failed=(12,)) -> FeatureStore:
    """14 images (train 12, val 1 = row 12, test 1), two captions each, tokenised; row 12 (the only
    val image) and any other ``failed`` rows failed."""
    from vsekit.tokenize import tokenize

    store = FeatureStore.create(tmp_path / "s.zarr", dataset="toy")
    store.write_images([f"im{i}" for i in range(N)], [f"{i}.jpg" for i in range(N)],
                       ["train"] * 12 + ["val", "test"])
    words = ["red", "green", "blue", "dog", "cat", "car", "tree"]
    text = [f"a {words[i % 7]} {words[(i + k) % 7]} photo" for i in range(N) for k in range(2)]
    store.write_captions(text, [i for i in range(N) for _ in range(2)])
    tokenize(store, min_count=1)
    x = np.random.default_rng(0).normal(size=(N, 8)).astype(np.float32)
    status = np.full(N, DONE, np.uint8)
    status[list(failed)] = FAILED
    fs = store.create_features("g", (8,), np.float32, attrs={"kind": "global", "model": "toy"}, block_rows=7)
    for b in fs.blocks():
        fs.write_block(b, x[b.start:b.stop], status[b.start:b.stop])
    fs.record_errors({int(r): "truncated JPEG" for r in failed})
    return FeatureStore.open(store.path)


TRAIN = ["--preset", "demo", "--epochs", "1", "--embed-dim", "8", "--word-dim", "8", "--batch-size", "4",
         "--no-progress", "--device", "cpu"]


def _train(store, out, *extra):
    return CliRunner().invoke(main, ["train", "--store", str(store.path), "--features", "g", "--model", "vse",
                                     "--out", str(out), *TRAIN, *extra])


def test_a_validation_split_without_usable_images_is_refused_with_what_to_do(tmp_path):
    store = _store(tmp_path)
    res = _train(store, tmp_path / "run")
    assert res.exit_code == 1, res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("Error:")][0]
    assert "the validation split 'val' has no usable images in 'g' (1 image; failed: row 12 (id im12): " \
           "truncated JPEG)" in line
    assert "--val-split test" in line and f"vsekit split --store {store.path} --val N --test N" in line
    assert not (tmp_path / "run" / "checkpoint_last.pt").exists() and not (tmp_path / "run" / "config.json").exists()


def test_val_split_chooses_the_rows_and_failed_and_small_splits_are_said(tmp_path):
    store = _store(tmp_path, failed=(3, 12))
    res = _train(store, tmp_path / "run", "--val-split", "test")
    assert res.exit_code == 0, res.output
    assert "note: 1 failed row of split 'train' in 'g' left out, with their captions: 11 of 12 images used" \
        in res.output
    assert "warning: the validation split 'test' has 1 usable image (under 100): the val rsum of each epoch" \
        in res.output
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["train"]["val_split"] == "test"
    # the run's validation was on the one test image: R@1 over one image and its 2 captions is 100
    log = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert log[-1]["val"]["rsum"] == 600.0   # what the warning is about: a perfect score that means nothing
    # evaluation on a split with a failed row says how many it left out
    res = CliRunner().invoke(main, ["evaluate", str(tmp_path / "run"), "--split", "train", "--no-progress",
                                    "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "1 failed row of split 'train' in 'g' left out, with their captions: 11 of 12 images used" in res.output
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["n_images"] == 11 and metrics["n_captions"] == 22


def test_info_lists_failed_rows_with_reasons_splits_and_the_two_ways_out(tmp_path):
    store = _store(tmp_path, failed=(3, 12))
    for args in ([str(store.path)], [str(store.path), "g"]):
        res = CliRunner().invoke(main, ["info", *args])
        assert res.exit_code == 0, res.output
        out = res.output
        assert "failed rows (2):" in out and "2 failed rows, by split: train 1, val 1" in out
        assert "3 (im3): truncated JPEG" in out and "12 (im12): truncated JPEG" in out
        assert "two ways out:" in out and "retry them: " in out
        assert "drop them: train and evaluate already skip them" in out and "--drop-failed" in out


def test_ingest_and_extract_say_when_a_split_is_tiny_or_has_no_usable_image(tmp_path):
    """The first hour of the issue: 14 images gave one validation image, the truncated one; neither
    ingest nor extract said a word."""
    import io

    from PIL import Image

    root = tmp_path / "photos"
    root.mkdir()
    for i in range(N):
        buf = io.BytesIO()
        Image.new("RGB", (24, 24), (i * 15, 80, 200 - i * 10)).save(buf, "JPEG")
        (root / f"{i}.jpg").write_bytes(buf.getvalue())
    (root / "captions.tsv").write_text("".join(f"{i}.jpg\ta photo number {i}\n" for i in range(N)))
    res = CliRunner().invoke(main, ["ingest", "folder", str(root), str(root / "captions.tsv"),
                                    "--store", str(tmp_path / "s.zarr")])
    assert res.exit_code == 0, res.output
    store = FeatureStore.open(tmp_path / "s.zarr")
    codes = store.image_splits()
    assert int((codes == 1).sum()) == 1   # the default 0.8,0.1,0.1 of 14 images
    assert "note: split 'val' has 1 image: validation or test figures on it are noise; " \
           f"`vsekit split --store {store.path} --val N --test N` re-splits" in res.output
    val_row = int(np.flatnonzero(codes == 1)[0])
    path = root / str(store.image_paths()[val_row])
    path.write_bytes(path.read_bytes()[:40])   # truncated
    res = CliRunner().invoke(main, ["extract", "--store", str(store.path), "--model", "test_resnet", "--weights",
                                    "none", "--input-size", "16", "--resize", "20", "--workers", "0",
                                    "--no-progress", "--name", "g"])
    assert res.exit_code == 0, res.output
    assert "warning: every val image failed in 'g' (1 of 1): training will refuse to validate on it" in res.output


def test_evaluating_a_run_after_a_resplit_warns_that_it_may_have_trained_on_the_test_images(tmp_path):
    import os
    import time

    store = _store(tmp_path, failed=())
    assert _train(store, tmp_path / "run").exit_code == 0
    args = ["evaluate", str(tmp_path / "run"), "--split", "test", "--no-progress", "--device", "cpu"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0 and "was re-split" not in res.output, res.output
    cfg = tmp_path / "run" / "config.json"
    os.utime(cfg, (time.time() - 60, time.time() - 60))   # trained a minute before the re-split
    assert CliRunner().invoke(main, ["split", "--store", str(store.path), "--val", "2", "--test", "2"]).exit_code == 0
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert f"was re-split (" in res.output and f"after {tmp_path / 'run'} was trained" in res.output
