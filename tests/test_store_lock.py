"""A store's own lock (issue 23, finding 3): two ingests into one new path, and ``ingest --overwrite``
of a store that a writer is writing in. Two real processes each time; the first is held at a pause
point (``VSEKIT_PAUSE``) so the race is deterministic."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from vsekit.cli import main
from vsekit.storage import FeatureStore

from test_crash_rerun import FAST, NAME, _paused, run


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith("Error: "), stderr
    return lines[0]


def test_second_ingest_into_the_same_new_path_is_refused(demo_dir, tmp_path):
    other = tmp_path / "other.json"          # the same dataset from another file: tells the stores apart
    shutil.copy(demo_dir / "dataset_demo.json", other)
    target, flag = tmp_path / "s.zarr", tmp_path / "go"
    first = _paused(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", str(target)],
                    "ingest:rename", flag)
    try:
        second = run("ingest", "karpathy", str(other), "--image-root", str(demo_dir), "--store", str(target))
        assert second.returncode == 1, second.stdout + second.stderr
        line = _error_line(second.stderr)
        assert str(target) in line and "being written by vsekit ingest (pid" in line
    finally:
        flag.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert FeatureStore.open(target).attrs["source_files"] == [str((demo_dir / "dataset_demo.json").resolve())]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".s.zarr")) == []


@pytest.mark.slow
def test_ingest_overwrite_is_refused_while_an_extract_writes_in_the_store(demo_dir, demo_store, tmp_path):
    flag = tmp_path / "go"
    first = _paused(["extract", "--store", str(demo_store.path), *FAST], "write_block:status@2", flag)
    try:
        second = run("ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", str(demo_store.path),
                     "--overwrite")
        assert second.returncode == 1, second.stdout + second.stderr
        line = _error_line(second.stderr)
        assert f"cannot replace {demo_store.path}" in line and f"'{NAME}'" in line and "vsekit extract" in line
    finally:
        flag.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err      # the extract finished in the store it started in
    fs = FeatureStore.open(demo_store.path).features(NAME)
    assert fs.counts()["pending"] == 0 and fs.counts()["done"] == fs.n_rows


def test_no_writer_starts_in_a_store_being_replaced(demo_dir, demo_store, tmp_path):
    flag = tmp_path / "go"
    first = _paused(["ingest", "karpathy", str(demo_dir / "dataset_demo.json"), "--store", str(demo_store.path),
                     "--overwrite"], "ingest:rename", flag)
    try:
        r = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), *FAST])
        assert r.exit_code == 1 and "is being replaced by vsekit ingest --overwrite" in r.output, r.output
    finally:
        flag.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert FeatureStore.open(demo_store.path).feature_names() == []
