"""Decoding workers never outlive the extract that started them (issue 23, finding 2).

Ctrl-C (SIGINT to the process group) and SIGTERM (to the main process only, as a scheduler or
``kill`` sends it) stop the run, keep the finished blocks, say so, and exit 130 / 143 with no
decoding worker left alive; after ``kill -9`` of the main process its workers end by themselves
(the parent-death check in each worker). The seconds these take are in BENCHMARKS.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from vsekit.storage import FeatureStore

from test_crash_rerun import env_for, vsekit_cmd

psutil = pytest.importorskip("psutil")

CMD = ["--model", "test_resnet", "--weights", "none", "--input-size", "32", "--resize", "36",
       "--batch-size", "4", "--block-rows", "4", "--workers", "2", "--no-progress"]
NAME = "test_resnet_global"


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def held_mid_run(store: Path, flag: Path, *more: str) -> tuple[subprocess.Popen, list]:
    """An extract with 2 decoding workers, held at its third batch once block 0 is in the store;
    returns it and its child processes (the decoding workers among them)."""
    proc = subprocess.Popen(vsekit_cmd("extract", "--store", str(store), *CMD, *more),
                            env=env_for(VSEKIT_PAUSE="extract:batch@3", VSEKIT_PAUSE_FILE=str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        if Path(f"{flag}.reached").exists() and (store / "features" / NAME).exists():
            if FeatureStore.open(store).features(NAME).counts()["done"] >= 4:
                break
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2, children   # the two decoding workers
    return proc, children


def alive(procs: list) -> list:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how,code", [("ctrl-c", 130), ("sigterm", 143)])
def test_interrupt_keeps_blocks_says_so_and_leaves_no_decoding_worker(demo_store, tmp_path, how, code):
    proc, children = held_mid_run(demo_store.path, tmp_path / "go")
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)     # what Ctrl-C does: the whole process group
    else:
        os.kill(proc.pid, signal.SIGTERM)      # the main process only, as `kill` or a scheduler does
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        left = alive(children)                # when the command has returned
        for p in left:
            p.kill()
    assert proc.returncode == code, err
    assert "interrupted: kept" in err and "rerun the same command to resume" in err and "Traceback" not in err
    assert left == []
    fs = FeatureStore.open(demo_store.path).features(NAME)
    assert fs.counts()["done"] >= 4 and not (demo_store.path / ".vsekit" / "locks" / f"{NAME}.lock").exists()


@pytest.mark.slow
def test_decoding_workers_end_when_the_main_process_is_killed(demo_store, tmp_path):
    # 128 px crops: a decoded batch (196 kB) is more than a pipe holds, so the workers are blocked
    # writing their results when the main process dies (torch's own parent check never runs then)
    proc, children = held_mid_run(demo_store.path, tmp_path / "go", "--input-size", "128", "--resize", "128")
    assert killed_leaves_no_child(proc, children) == []


def killed_leaves_no_child(proc: subprocess.Popen, children: list) -> list:
    """``kill -9`` of ``proc``: the ``children`` still alive 30 s later (killed then), for the caller
    to assert empty."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)   # not communicate(): a surviving worker would hold its output pipes open
    deadline = time.monotonic() + 30   # a bound, not a timing claim: measured figures in BENCHMARKS.md
    try:
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.05)
        return alive(children)
    finally:
        for p in alive(children):
            p.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.slow
def test_sigterm_before_the_extraction_starts_releases_the_lock_and_exits_143(demo_store, tmp_path):
    flag = tmp_path / "go"
    proc = subprocess.Popen(vsekit_cmd("extract", "--store", str(demo_store.path), *CMD),
                            env=env_for(VSEKIT_PAUSE="create_features:attrs", VSEKIT_PAUSE_FILE=str(flag)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not Path(f"{flag}.reached").exists():   # holding the lock, creating the set
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "interrupted before the extraction started" in err and "Traceback" not in err
    assert not (demo_store.path / ".vsekit" / "locks" / f"{NAME}.lock").exists()
    assert FeatureStore.open(demo_store.path).feature_names() == []
