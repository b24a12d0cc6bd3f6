"""Hostile ingest input: Karpathy JSON fields of the wrong type, image paths outside the image root,
a wrong image root, and the leftover of a killed ingest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from vsekit.cli import main



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
