"""Fault injection (issue 19): a process killed just before a named write (``VSEKIT_FAULT``), then
rerun, must leave exactly what an uninterrupted run leaves, bit for bit; a second writer is refused.

Each interrupted run is a subprocess that ends itself with ``os._exit(137)`` at the named point
(see ``vsekit.storage.faults``), so the fault is deterministic: no sleeps, no timing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vsekit.storage import FeatureStore
from vsekit.storage.integrity import SUMS

SRC = Path(__file__).resolve().parents[1] / "src"
FAST = ["--model", "test_resnet", "--weights", "none", "--input-size", "32", "--resize", "36",
        "--batch-size", "4", "--block-rows", "4", "--no-progress", "--workers", "0"]
NAME = "test_resnet_global"


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VSEKIT_")}
    env.update(PYTHONPATH=f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", **extra)
    return env


def vsekit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())", *args]


def run(*args: str, fault: str | None = None, **env: str) -> subprocess.CompletedProcess:
    if fault:
        env["VSEKIT_FAULT"] = fault
    return subprocess.run(vsekit_cmd(*args), env=env_for(**env), capture_output=True, text=True, timeout=300)


def snapshot(store_path: Path, name: str) -> dict:
    """Every array of the set (as raw bytes, so NaNs compare too) and its attrs (but the random
    ``generation`` ids every creation makes)."""
    fs = FeatureStore.open(store_path).features(name)
    out = {"attrs": {k: v for k, v in fs.attrs.items() if k not in ("generation", "parent_generation")}}
    for key in sorted(fs.group.array_keys()):
        a = np.asarray(fs.group[key][:])
        out[key] = (a.dtype.str, a.shape, a.tobytes())
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == b[key], f"{key} differs"


@pytest.fixture(scope="module")
def base_store(demo_dir, tmp_path_factory):
    """24 demo images plus one missing file (row 1: a failed row with a reason, in block 0)."""
    tmp = tmp_path_factory.mktemp("faults")
    demo = FeatureStore.open(_ingested(demo_dir, tmp))
    paths = list(demo.image_paths())
    paths.insert(1, "missing.jpg")
    store = FeatureStore.create(tmp / "s.zarr", dataset="t", image_root=demo.image_root)
    store.write_images([f"i{k}" for k in range(len(paths))], paths, ["train"] * len(paths))
    return store.path


@pytest.fixture()
def image_store(base_store, tmp_path):
    path = tmp_path / "s.zarr"
    shutil.copytree(base_store, path)
    return path


def _ingested(demo_dir: Path, tmp_path: Path) -> Path:
    from vsekit.storage.sources.karpathy import ingest_karpathy

    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "demo.zarr")
    return store.path


@pytest.fixture(scope="module")
def reference(base_store, tmp_path_factory):
    """The uninterrupted extraction, in a copy of the store."""
    ref = tmp_path_factory.mktemp("ref") / "ref.zarr"
    shutil.copytree(base_store, ref)
    r = run("extract", "--store", str(ref), *FAST)
    assert r.returncode == 0, r.stderr
    return snapshot(ref, NAME)


_slow = pytest.mark.slow   # each case is three subprocess runs (the whole test is slow; kept for the list)
EXTRACT_POINTS = [pytest.param("create_features:arrays", marks=_slow), "create_features:attrs",
                  pytest.param("create_features:rename", marks=_slow), pytest.param("record_errors", marks=_slow),
                  pytest.param("write_block:data@2", marks=_slow), pytest.param("write_block:sums@2", marks=_slow),
                  "write_block:status@2", pytest.param("write_block:status@7", marks=_slow)]


@pytest.mark.slow
@pytest.mark.parametrize("point", EXTRACT_POINTS)
def test_extract_killed_at_any_write_point_then_rerun_equals_uninterrupted(point, image_store, reference):
    killed = run("extract", "--store", str(image_store), *FAST, fault=point)
    assert killed.returncode == 137, killed.stderr
    assert (image_store / ".vsekit" / "locks" / f"{NAME}.lock").exists()   # a kill leaves its lock
    again = run("extract", "--store", str(image_store), *FAST)
    assert again.returncode == 0, again.stderr
    assert not (image_store / ".vsekit" / "locks" / f"{NAME}.lock").exists()   # released on exit
    assert_same(snapshot(image_store, NAME), reference)
    assert FeatureStore.open(image_store).features(NAME).errors()[1].startswith("missing file")
    assert not [p for p in (image_store / "features").iterdir() if p.name.startswith(".")]


# standardize --------------------------------------------------------------------------------------
def _parent_store(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    store = FeatureStore.create(tmp_path / "p.zarr", dataset="t")
    n = 22
    store.write_images([f"i{k}" for k in range(n)], [f"{k}.jpg" for k in range(n)],
                       ["train"] * 16 + ["test"] * 6)
    fs = store.create_features("p", (6,), "float32", attrs={"kind": "global", "model": "m"}, block_rows=4)
    for b in fs.blocks():
        status = np.ones(len(b), np.uint8)
        if b.index == 1:
            status[2] = 2
        fs.write_block(b, rng.normal(size=(len(b), 6)).astype(np.float32), status)
    fs.record_errors({6: "missing file x.jpg"})
    return store.path


STANDARDIZE_POINTS = ["create_features:arrays", "standardize:stats", "create_features:attrs",
                      "create_features:rename", "write_block:data@2", "write_block:status@3",
                      "record_errors"]


@pytest.mark.slow
@pytest.mark.parametrize("point", STANDARDIZE_POINTS)
def test_standardize_killed_at_any_write_point_then_rerun_equals_uninterrupted(point, tmp_path):
    path = _parent_store(tmp_path)
    ref = tmp_path / "ref.zarr"
    shutil.copytree(path, ref)
    assert run("standardize", "--store", str(ref), "--features", "p").returncode == 0
    killed = run("standardize", "--store", str(path), "--features", "p", fault=point)
    assert killed.returncode == 137, killed.stderr
    again = run("standardize", "--store", str(path), "--features", "p")
    assert again.returncode == 0, again.stderr
    assert_same(snapshot(path, "p.z"), snapshot(ref, "p.z"))
    # the statistics are numpy's over the train rows that are done
    parent = FeatureStore.open(path).features("p")
    x = np.asarray(parent.data[:16], np.float64)[np.asarray(parent.status[:16]) == 1]
    np.testing.assert_allclose(FeatureStore.open(path).features("p.z").array("mean")[:], x.mean(0), rtol=1e-12)


@pytest.mark.slow
def test_standardize_overwrite_killed_mid_swap_keeps_a_whole_set(tmp_path):
    path = _parent_store(tmp_path)
    assert run("standardize", "--store", str(path), "--features", "p").returncode == 0
    killed = run("standardize", "--store", str(path), "--features", "p", "--split", "train,test",
                 "--overwrite", fault="create_features:swap")
    assert killed.returncode == 137
    again = run("standardize", "--store", str(path), "--features", "p", "--split", "train,test", "--overwrite")
    assert again.returncode == 0, again.stderr
    fs = FeatureStore.open(path).features("p.z")
    assert fs.attrs["split"] == "train,test" and fs.is_complete()
    assert not [p for p in (path / "features").iterdir() if p.name.startswith(".")]


def test_standardize_rerun_rewrites_a_deleted_chunk_of_its_output(tmp_path):
    from vsekit.fne import standardize
    from vsekit.storage.integrity import _chunk_file

    path = _parent_store(tmp_path)
    standardize(path, "p")
    before = snapshot(path, "p.z")
    _chunk_file(FeatureStore.open(path).features("p.z"), "data", 3).unlink()
    result = standardize(path, "p")
    assert result.blocks_written == 1
    assert_same(snapshot(path, "p.z"), before)


# one writer per set --------------------------------------------------------------------------------
def _paused(args: list[str], point: str, flag: Path) -> subprocess.Popen:
    proc = subprocess.Popen(vsekit_cmd(*args), env=env_for(VSEKIT_PAUSE=point, VSEKIT_PAUSE_FILE=str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reached = Path(f"{flag}.reached")
    deadline = time.monotonic() + 120
    while not reached.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run never reached its pause point"
        time.sleep(0.02)
    return proc


@pytest.mark.slow
def test_second_writer_with_overwrite_is_refused_and_first_result_is_intact(image_store, reference, tmp_path):
    flag = tmp_path / "go"
    first = _paused(["extract", "--store", str(image_store), *FAST], "write_block:status@2", flag)
    try:
        second = run("extract", "--store", str(image_store), *FAST, "--resize", "40", "--overwrite")
        assert second.returncode == 1
        assert "is being written by vsekit extract (pid" in second.stderr and "Traceback" not in second.stderr
    finally:
        flag.touch()
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert_same(snapshot(image_store, NAME), reference)


@pytest.mark.slow
def test_concurrent_tokenize_is_refused_and_leaves_no_partial(demo_dir, tmp_path):
    path = _ingested(demo_dir, tmp_path)
    flag = tmp_path / "go"
    first = _paused(["tokenize", "--store", str(path), "--min-count", "1"], "tokenize:swap", flag)
    try:
        second = run("tokenize", "--store", str(path), "--min-count", "2")
        assert second.returncode == 1
        assert "'tokens'" in second.stderr and "being written by vsekit tokenize" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        flag.touch()
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    store = FeatureStore.open(path)
    assert store.has_tokens and "tokens_partial" not in store.root
    assert store.root["tokens"].attrs["min_count"] == 1


@pytest.mark.slow
def test_tokenize_killed_before_swap_leaves_partial_that_the_rerun_removes(demo_dir, tmp_path):
    path = _ingested(demo_dir, tmp_path)
    assert run("tokenize", "--store", str(path), fault="tokenize:swap").returncode == 137
    assert (path / "tokens_partial").exists()
    r = run("tokenize", "--store", str(path))
    assert r.returncode == 0, r.stderr
    assert not (path / "tokens_partial").exists() and FeatureStore.open(path).has_tokens


def _write_lock(store: Path, name: str, **info) -> Path:
    import json

    from vsekit.storage.lock import lock_path

    p = lock_path(store, name)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"stage": "vsekit extract", "started": time.time(), "token": "x", **info}))
    return p


def test_stale_and_live_locks(tmp_path, monkeypatch):
    from vsekit.storage.lock import LockHeld, writer_lock

    store = tmp_path / "s.zarr"
    store.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    # same host, dead pid: broken
    _write_lock(store, "a", host=here, pid=dead.pid)
    with writer_lock(store, "a"):
        pass
    # same host, live pid (this process, not through this process's registry): refused
    p = _write_lock(store, "a", host=here, pid=os.getpid())
    with pytest.raises(LockHeld, match=r"being written by vsekit extract \(pid"):
        with writer_lock(store, "a"):
            pass
    # another host: refused while fresh, broken once older than VSEKIT_LOCK_STALE_S
    p = _write_lock(store, "a", host="elsewhere.invalid", pid=1)
    with pytest.raises(LockHeld, match="VSEKIT_BREAK_LOCK=1"):
        with writer_lock(store, "a"):
            pass
    old = time.time() - 7200
    os.utime(p, (old, old))
    with writer_lock(store, "a"):
        pass
    _write_lock(store, "a", host="elsewhere.invalid", pid=1)
    monkeypatch.setenv("VSEKIT_BREAK_LOCK", "1")
    with writer_lock(store, "a"):
        assert p.exists()
    assert not p.exists()
    monkeypatch.delenv("VSEKIT_BREAK_LOCK")
    # released on an exception, and re-entrant in one process
    with pytest.raises(RuntimeError):
        with writer_lock(store, "b"):
            with writer_lock(store, "b"):
                pass
            assert (store / ".vsekit" / "locks" / "b.lock").exists()
            raise RuntimeError
    assert not (store / ".vsekit" / "locks" / "b.lock").exists()


def test_standardize_refused_while_another_process_holds_the_lock(tmp_path):
    from click.testing import CliRunner

    from vsekit.cli import main

    path = _parent_store(tmp_path)
    _write_lock(path, "p.z", host=socket.gethostname(), pid=os.getppid())
    for cmd in (["standardize", "--store", str(path), "--features", "p", "--overwrite"],
                ["fne", "--store", str(path), "--features", "p"]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 1 and "'p.z'" in r.output and "being written by" in r.output, r.output
    assert not FeatureStore.open(path).has_features("p.z")


def test_fault_points_read_the_environment_once_per_process(monkeypatch):
    """The fault variables are read at the first point of a process (one module, storage/faults.py),
    and a point then costs one test of a global: a variable set later in the process is not seen."""
    from vsekit.storage import faults

    class Killed(Exception):
        pass

    def exit_(code):
        raise Killed(code)

    monkeypatch.setattr(faults.os, "_exit", exit_)
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.delenv("VSEKIT_FAULT", raising=False)
    monkeypatch.delenv("VSEKIT_PAUSE", raising=False)
    monkeypatch.setattr(faults, "_config", None)   # as in a new process
    faults.point("test:here")
    assert faults._config is False   # off: nothing else is looked at
    monkeypatch.setenv("VSEKIT_FAULT", "test:here@2")
    faults.point("test:here")        # not read again: no fault
    monkeypatch.setattr(faults, "_config", None)   # a new process with the variable set
    faults.point("test:here")        # the first hit of two
    with pytest.raises(Killed, match="137"):
        faults.point("test:here")
