"""``--cluster sge:N`` against a real single-node Grid Engine (Debian's gridengine 8.1.9: qmaster and
execd on this host, one queue ``all.q`` of 2 slots), started by tests/sge_local.py. ``.ci/run``
installs the packages with apt; elsewhere (or not as root) these tests skip, saying why.

The same fault study as tests/test_slurm.py, counted on disk: every block commit of the Grid Engine
workers is logged with its job id (tests/commit_log/sitecustomize.py; the jobs inherit the
PYTHONPATH through ``-V``). A happy run bit-equal to in-process, a job deleted (``qdel``) after it
committed blocks, a refused submission, Ctrl-C and SIGTERM to the driver, a walltime of one minute
with work for several.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dask_jobqueue", reason="dask-jobqueue not installed (pip install 'vsekit[slurm]')")
torch = pytest.importorskip("torch")

import sge_local  # noqa: E402  (tests/sge_local.py)
from conftest import wait_until as _wait  # noqa: E402
from test_slurm import CLI, INSTRUMENT, OPTS, commits  # noqa: E402  (the same counting as on SLURM)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sge():
    """A running one-node Grid Engine; yields the environment its clients need."""
    why = sge_local.unavailable()
    if why:
        pytest.skip(why)
    with sge_local.local_sge() as env:
        yield {"env": env}


@pytest.fixture()
def on_sge(sge, monkeypatch, tmp_path):
    """Route ``sge:N`` to the test Grid Engine: its cell, loopback only, logs in tmp_path."""
    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, sge["env"][key])
    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "jobs").mkdir()
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({
        "interface": "lo", "cores": 1, "memory": "2GB", "memory_resource": "h_rss", "walltime": "00:20:00",
        "queue": sge_local.QUEUE,
        "python": sys.executable, "log_directory": str(tmp_path / "jobs")}))
    yield sge
    sge_local.delete_all(sge["env"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir):
    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy

    torch.set_num_threads(1)
    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir,
                               tmp_path_factory.mktemp("ref") / "ref.zarr")
    res = extract(store, workers=0, **OPTS)
    assert res.done == store.n_images
    return store


@pytest.fixture()
def commit_log(on_sge, monkeypatch, tmp_path):
    """Every block a Grid Engine worker commits is logged with its JOB_ID, and every batch sleeps
    0.4 s first, so the test can act while blocks are in flight."""
    log = tmp_path / "commits.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(INSTRUMENT), os.environ["PYTHONPATH"]]))
    monkeypatch.setenv("VSEKIT_TEST_COMMIT_LOG", str(log))
    monkeypatch.setenv("VSEKIT_TEST_BATCH_DELAY", "0.4")
    return log


def _qstat(env) -> list[str]:
    return sge_local.jobs(env)


def _per_block(log: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for _, block, _ in commits(log):
        out[block] = out.get(block, 0) + 1
    return out


def test_extract_and_standardize_on_sge_equal_in_process(on_sge, commit_log, demo_store, reference):
    """sge:2: every block computed by Grid Engine jobs (their JOB_IDs in the log), each once, the
    features and their standardisation bit-equal to the in-process run; no job is left queued."""
    from vsekit.extract import extract
    from vsekit.fne import standardize

    res = extract(demo_store, cluster="sge:2", **OPTS)
    fs = demo_store.features(res.name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(res.name).data[:])  # bit for bit
    n_blocks = len(fs.blocks())
    assert _per_block(commit_log) == {b: 1 for b in range(n_blocks)}
    assert all(job.isdigit() for _, _, job in commits(commit_log))   # committed inside Grid Engine jobs
    z_ref = standardize(reference, res.name)
    z = standardize(demo_store, res.name, cluster="sge:1")
    assert np.array_equal(demo_store.features(z.name).data[:], reference.features(z_ref.name).data[:])
    deadline = time.time() + 30
    while _qstat(on_sge["env"]) and time.time() < deadline:
        time.sleep(0.5)
    assert not _qstat(on_sge["env"])   # every job ended with its cluster


def test_deleted_job_that_committed_blocks_has_none_recomputed(on_sge, commit_log, demo_store, reference):
    """qdel a job after it provably committed a block (its commit is in the log): the job is
    replaced, every block reaches the disk exactly once and the result equals the in-process run."""
    from vsekit.extract import extract

    result: dict = {}

    def run():
        try:
            result["res"] = extract(demo_store, cluster="sge:2", **OPTS)
        except BaseException as exc:  # surfaced below
            result["exc"] = exc

    t = threading.Thread(target=run)
    t.start()
    env = on_sge["env"]
    n_blocks = -(-demo_store.n_images // OPTS["block_rows"])
    deleted, committed_before = None, 0
    deadline = time.time() + 240
    while time.time() < deadline and t.is_alive():   # a job with a commit, and work left for the other
        done = commits(commit_log)
        by_job: dict[str, int] = {}
        for _, _, job in done:
            by_job[job] = by_job.get(job, 0) + 1
        jobs = sge_local.running(env)
        ready = [j for j in jobs if by_job.get(j)]
        if ready and len(done) <= n_blocks - 4 and len(jobs) == 2:
            deleted = ready[0]
            subprocess.run([sge_local.which("qdel"), deleted], env=env, check=True, capture_output=True)
            committed_before = by_job[deleted]
            break
        time.sleep(0.05)
    t.join(300)
    assert not t.is_alive()
    if "exc" in result:
        raise result["exc"]
    assert deleted is not None and committed_before >= 1, "no job could be deleted after a commit"
    fs = demo_store.features(result["res"].name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(fs.name).data[:])
    assert _per_block(commit_log) == {b: 1 for b in range(n_blocks)}   # each block on disk exactly once
    jobs = {job for _, _, job in commits(commit_log)}
    assert deleted in jobs and len(jobs) >= 2


def _cli_extract(store, cluster: str, tmp_path: Path, device: str = "cpu") -> subprocess.Popen:
    """``vsekit extract`` of OPTS in its own process (its environment: this test's, the cell included)."""
    args = [sys.executable, *CLI, "extract", "--store", str(store.path), "--model", "test_resnet", "--kind",
            "fne", "--weights", "none", "--seed", "3", "--input-size", "64", "--resize", "72",
            "--batch-size", "2", "--block-rows", "2", "--device", device, "--cluster", cluster, "--no-progress"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.err", "w"),
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_to_the_driver_stops_the_run_deletes_its_jobs_and_keeps_rows(
        on_sge, commit_log, demo_store, tmp_path, sig, code):
    """Ctrl-C exits 130 and SIGTERM 143, each with the kept-rows line and no traceback; the run's
    jobs leave the queue within 30 s, the lock is released, nothing is committed after the driver
    ended, and the kept rows are exactly the logged commits."""
    from vsekit.storage.lock import lock_path

    env = on_sge["env"]
    proc = _cli_extract(demo_store, "sge:2", tmp_path)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not commits(commit_log):
        time.sleep(0.05)
    assert proc.poll() is None and commits(commit_log), "no block was committed while the run was going"
    ours = set(_qstat(env))
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    gone_at = time.time()
    err = (tmp_path / "driver.err").read_text()
    assert proc.returncode == code, err[-3000:]
    assert "interrupted: kept" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err
    while time.time() < gone_at + 30 and ours & set(_qstat(env)):
        time.sleep(0.5)
    assert not ours & set(_qstat(env)), "the run's Grid Engine jobs were not deleted"
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    time.sleep(3)   # a worker still running a batch would commit it now
    logged = commits(commit_log)
    assert all(float(ln.split()[4]) <= gone_at for ln in commit_log.read_text().splitlines())
    done = int((demo_store.features("test_resnet_fne").status[:] == 1).sum())
    assert done == 2 * len(logged)   # the kept rows are what was committed, once each
    assert f"kept {done} done" in err


@pytest.mark.parametrize("config, device, says", [
    ({"queue": "nosuch.q"}, "cpu", 'unknown queue "nosuch.q"'),
    ({}, "cuda", 'unknown resource "gpu"'),   # --device cuda here: gpus 1, and this cell has no gpu resource
], ids=["queue", "gpu"])
def test_refused_submission_is_one_error_line_and_leaves_nothing(on_sge, demo_store, tmp_path, monkeypatch,
                                                                  config, device, says):
    """A job Grid Engine refuses is qsub's own message (``qsub -w v``) in one ``Error:`` line, within
    the verification's time, with no traceback; the lock is released, no empty set is left, no job
    was queued. ``--device cuda`` is not checked on this (submit) host: the refusal is Grid
    Engine's, about the GPU resource it lacks."""
    from vsekit.storage import FeatureStore
    from vsekit.storage.lock import lock_path

    cfg = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({**cfg, **config}))
    proc = _cli_extract(demo_store, "sge:2", tmp_path, device=device)
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "driver.err").read_text()
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --cluster sge:2: Grid Engine refuses the job:"), err
    assert says in lines[0]
    assert "--device" not in lines[0]
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    assert not FeatureStore.open(demo_store.path).has_features("test_resnet_fne")
    assert not _qstat(on_sge["env"])


def test_walltime_of_one_minute_jobs_are_replaced_and_the_run_completes(on_sge, commit_log, demo_store,
                                                                         reference, monkeypatch):
    """h_rt of 60 s and about two minutes of work (every batch sleeps 10 s) on sge:2: workers retire
    before their walltime (--lifetime), new jobs take over, and the run completes bit-equal to the
    in-process one with every block committed once, by at least three jobs."""
    from vsekit.extract import extract

    cfg = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({**cfg, "walltime": "00:01:00"}))
    monkeypatch.setenv("VSEKIT_TEST_BATCH_DELAY", "10")
    result: dict = {}

    def run():
        try:
            result["res"] = extract(demo_store, cluster="sge:2", **OPTS)
        except BaseException as exc:  # surfaced below
            result["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(420)
    assert not t.is_alive(), f"the run hung; commits so far: {commits(commit_log)}"
    if "exc" in result:
        raise result["exc"]
    fs = demo_store.features(result["res"].name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(fs.name).data[:])
    assert _per_block(commit_log) == {b: 1 for b in range(len(fs.blocks()))}
    assert len({job for _, _, job in commits(commit_log)}) >= 3   # jobs were replaced along the way


def test_workers_commit_nothing_once_the_driver_is_killed(on_sge, commit_log, demo_store, tmp_path):
    """The driver killed outright (SIGKILL: nothing deletes its jobs): the workers still running
    tasks commit none of them, since the writer lock they check is no longer held."""
    env, ours = on_sge["env"], set()
    proc = _cli_extract(demo_store, "sge:2", tmp_path)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and not commits(commit_log):
            time.sleep(0.05)
        assert proc.poll() is None and commits(commit_log), "no block was committed while the run was going"
        ours = set(_qstat(env))
        proc.kill()
        proc.wait(30)
        killed_at = time.time()
        time.sleep(6)   # in-flight batches (0.4 s each) finish and reach their commit
        late = [ln for ln in commit_log.read_text().splitlines() if float(ln.split()[4]) > killed_at + 0.5]
        assert not late, f"committed after the driver was killed: {late}"
    finally:
        if proc.poll() is None:
            proc.kill()
        if ours:
            subprocess.run([sge_local.which("qdel"), *sorted(ours)], env=env, capture_output=True)


def test_jobs_that_never_start_end_in_an_error_with_their_qstat_state(on_sge, demo_store, monkeypatch):
    """A bounded wait: jobs still queued after ``start_timeout`` (here ``-a``: not before 2030) stop
    the run with each job's qstat state (``qw``), deleted, the lock released, no set left."""
    from vsekit.extract import extract
    from vsekit.storage.lock import lock_path

    cfg = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({**cfg, "job_extra": ["-a 203001010000"],
                                                             "start_timeout": 8}))
    with pytest.raises(ValueError, match=r"no Grid Engine job started within 8 s \(start_timeout\); "
                                         r"qstat: job \d+ qw"):
        extract(demo_store, cluster="sge:1", **OPTS)
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    assert not demo_store.has_features("test_resnet_fne")
    deadline = time.time() + 30
    while _qstat(on_sge["env"]) and time.time() < deadline:
        time.sleep(0.5)
    assert not _qstat(on_sge["env"])


# --- sge-array:N: a qsub -t job array, no driver ------------------------------------------------------
def test_sge_array_with_a_deleted_task_then_the_rerun_complete_every_block_once(
        on_sge, commit_log, demo_store, reference, monkeypatch):
    """sge-array:2: one ``qsub -t 1-2`` array whose tasks claim blocks by lease. Task 1 is deleted
    (``qdel -t 1``) after a block was committed; the other task takes over its expired lease, and
    the same command run again (if any block is left) fills the rest: every block on disk exactly
    once, bit-equal to the in-process run; ``vsekit info`` names the Grid Engine array meanwhile."""
    from vsekit.extract import extract
    from vsekit.storage import FeatureStore
    from vsekit.storage.info import describe

    env = on_sge["env"]
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "10")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sub = extract(demo_store, cluster="sge-array:2", **OPTS)
    name, job = sub.name, sub.job_id
    assert job and job.isdigit() and sub.tasks == 2 and "Grid Engine job array" in sub.summary()
    text = _wait(lambda: "leases:" in (t := describe(FeatureStore.open(demo_store.path), name)) and t, 120,
                 "vsekit info of the running array")
    assert f"Grid Engine job array {job} (2 tasks): queued or running" in text
    _wait(lambda: any(j == f"{job}.1" for _, _, j in commits(commit_log)), 240, "task 1 to commit a block")
    subprocess.run([sge_local.which("qdel"), job, "-t", "1"], env=env, check=True, capture_output=True)
    _wait(lambda: job not in _qstat(env), 300, f"array {job} to end")
    from vsekit.storage.lock import holder   # the one takeover rule: an ended array's lock until it expires

    _wait(lambda: holder(demo_store.path, name) is None, 120, "the ended array's lock to expire")
    again = extract(demo_store, cluster="sge-array:2", **OPTS)   # the same command fills any gap
    if again.job_id is not None:
        _wait(lambda: again.job_id not in _qstat(env), 300, f"array {again.job_id} to end")
    fs = FeatureStore.open(demo_store.path).features(name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(name).data[:])   # bit for bit
    assert _per_block(commit_log) == {b: 1 for b in range(len(fs.blocks()))}   # each block once
    tasks = {j for _, _, j in commits(commit_log)}
    assert f"{job}.1" in tasks and tasks <= {f"{job}.1", f"{job}.2", f"{again.job_id}.1", f"{again.job_id}.2"}
    _wait(lambda: holder(demo_store.path, name) is None, 120, "the ended array's lock to expire")
    assert extract(demo_store, cluster="sge-array:2", **OPTS).job_id is None   # a finished set says so


def test_sge_array_refused_by_qsub_is_one_error_line_and_leaves_nothing(on_sge, demo_store, tmp_path, monkeypatch):
    """A job array Grid Engine refuses (``qsub -w e``: a queue that does not exist) is qsub's own
    message in one ``Error:`` line; the lock is released, no set is left, nothing is queued."""
    from vsekit.storage import FeatureStore
    from vsekit.storage.lock import lock_path

    cfg = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({**cfg, "queue": "nosuch.q"}))
    proc = _cli_extract(demo_store, "sge-array:2", tmp_path)
    proc.communicate(timeout=120)
    err = (tmp_path / "driver.err").read_text()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1, err
    assert lines[0].startswith("Error: --cluster sge-array:2: qsub refused the job array: Unable to run job")
    assert 'unknown queue "nosuch.q"' in lines[0]
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    assert not FeatureStore.open(demo_store.path).has_features("test_resnet_fne")
    assert not _qstat(on_sge["env"])


def test_a_running_sge_array_holds_the_set_against_other_writers(on_sge, demo_store, tmp_path, monkeypatch):
    """While Grid Engine knows the array (``qstat -j``; here its one task is held at its start),
    another extract of the same set is refused; once the array is deleted and gone and its lock has
    expired, the next run proceeds and completes the set."""
    from vsekit.extract import extract
    from vsekit.storage.lock import LockHeld, lock_path

    env = on_sge["env"]
    monkeypatch.setenv("VSEKIT_PAUSE", f"array-task-1:start={tmp_path / 'never'}")
    monkeypatch.setenv("VSEKIT_PAUSE_MAX_S", "600")
    job = extract(demo_store, cluster="sge-array:1", **OPTS).job_id
    assert job in _qstat(env)
    with pytest.raises(LockHeld, match="sge-array"):
        extract(demo_store, workers=0, **OPTS)
    subprocess.run([sge_local.which("qdel"), job], env=env, check=True, capture_output=True)
    _wait(lambda: job not in _qstat(env), 60, f"array {job} to leave the queue")
    monkeypatch.delenv("VSEKIT_PAUSE")
    lock = lock_path(demo_store.path, "test_resnet_fne")   # what waiting out its ttl does (the one takeover
    old = time.time() - 7200                                # rule: gone from the queue AND expired)
    os.utime(lock, (old, old))
    res = extract(demo_store, workers=0, **OPTS)
    assert res.done == demo_store.n_images
