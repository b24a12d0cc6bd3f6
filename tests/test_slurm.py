"""``--cluster slurm:N`` against a real single-node SLURM (Debian's slurm-wlm + munge), started here on
127.0.0.1: munged, slurmctld and slurmd with a minimal slurm.conf in a temporary folder.

Extraction, FNE standardisation and tokenisation on SLURM must equal the in-process result. What a
cluster does to a run is tested by counting what reaches the disk: every block commit of the SLURM
workers is logged with its job id (tests/commit_log/sitecustomize.py, which wraps the store's
``write_block`` in every process started with it on the PYTHONPATH). A job cancelled after it
committed blocks, jobs past their walltime, a refused submission, jobs that never start, Ctrl-C,
SIGTERM and SIGKILL to the driver. ``.ci/run`` installs the packages with apt; elsewhere the tests
skip, saying which program is missing.
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

import slurm_local  # noqa: E402  (tests/slurm_local.py)

# all of them start (or share) a real SLURM and its jobs: minutes, so in the slow set that .ci/run runs
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node SLURM on 127.0.0.1; yields the environment its clients need."""
    why = slurm_local.unavailable()
    if why:
        pytest.skip(why)
    with slurm_local.local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield {"env": env}


@pytest.fixture()
def on_slurm(slurm, monkeypatch, tmp_path):
    """Route ``slurm:N`` to the test SLURM: its config, loopback only, logs in tmp_path."""
    monkeypatch.setenv("SLURM_CONF", slurm["env"]["SLURM_CONF"])
    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({
        "interface": "lo", "cores": 1, "memory": "2GB", "walltime": "00:20:00", "queue": "vsekit",
        "python": sys.executable, "log_directory": str(tmp_path / "jobs")}))
    return slurm


def _squeue(env) -> list[str]:
    return slurm_local.jobs(env)


OPTS = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
            crops=1, batch_size=2, block_rows=2, progress=False, device="cpu")


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


def test_extract_standardize_tokenize_on_slurm_equal_in_process(on_slurm, demo_store, reference):
    from vsekit.fne import standardize
    from vsekit.extract import extract
    from vsekit.tokenize import tokenize

    res = extract(demo_store, cluster="slurm:2", **OPTS)
    fs = demo_store.features(res.name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(res.name).data[:])  # bit for bit
    assert set(res.block_runs.values()) == {1} and len(res.model_builds) >= 1

    z_ref = standardize(reference, res.name)
    z = standardize(demo_store, res.name, cluster="slurm:2")
    assert np.array_equal(demo_store.features(z.name).data[:], reference.features(z_ref.name).data[:])

    tokenize(reference, min_count=1)
    tokenize(demo_store, min_count=1, cluster="slurm:1", chunk_captions=32)
    for arr in ("tokens/ids", "tokens/offsets"):
        assert np.array_equal(demo_store.root[arr][:], reference.root[arr][:])
    assert demo_store.root["tokens"].attrs["vocabulary"] == reference.root["tokens"].attrs["vocabulary"]
    assert not _squeue(on_slurm["env"])  # every job ended with its cluster


INSTRUMENT = Path(__file__).resolve().parent / "commit_log"   # its sitecustomize.py logs every commit


@pytest.fixture()
def commit_log(on_slurm, monkeypatch, tmp_path):
    """Every block a SLURM worker commits is logged (tests/commit_log/sitecustomize.py), and every
    batch sleeps 0.4 s first, so the test can act while blocks are in flight."""
    log = tmp_path / "commits.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(INSTRUMENT), os.environ["PYTHONPATH"]]))
    monkeypatch.setenv("VSEKIT_TEST_COMMIT_LOG", str(log))
    monkeypatch.setenv("VSEKIT_TEST_BATCH_DELAY", "0.4")
    return log


def commits(log: Path) -> list[tuple[str, int, str]]:
    """(set, block, SLURM job id) of every logged commit."""
    if not log.exists():
        return []
    rows = [ln.split() for ln in log.read_text().splitlines() if ln.strip()]
    return [(r[0], int(r[1]), r[2]) for r in rows]


def test_cancelled_job_that_committed_blocks_has_none_recomputed(on_slurm, commit_log, demo_store, reference):
    """Finding 1: scancel a job after it provably committed a block (its commit is in the log); every
    block must reach the disk exactly once and the result equal the in-process run bit for bit."""
    from vsekit.extract import extract

    result: dict = {}

    def run():
        try:
            result["res"] = extract(demo_store, cluster="slurm:2", **OPTS)
        except BaseException as exc:  # surfaced below
            result["exc"] = exc

    t = threading.Thread(target=run)
    t.start()
    env = on_slurm["env"]
    n_blocks = -(-demo_store.n_images // OPTS["block_rows"])
    cancelled, committed_before = None, 0
    deadline = time.time() + 240
    while time.time() < deadline and t.is_alive():  # a job with a commit, and work left for the other
        done = commits(commit_log)
        by_job = {}
        for _, _, job in done:
            by_job[job] = by_job.get(job, 0) + 1
        jobs = _squeue(env)
        ready = [j for j in jobs if by_job.get(j)]
        if ready and len(done) <= n_blocks - 4 and len(jobs) == 2:
            cancelled = ready[0]
            subprocess.run([slurm_local.which("scancel"), cancelled], env=env, check=True)
            committed_before = by_job[cancelled]
            break
        time.sleep(0.05)
    t.join(300)
    assert not t.is_alive()
    if "exc" in result:
        raise result["exc"]
    assert cancelled is not None and committed_before >= 1, "no job could be cancelled after a commit"
    res = result["res"]
    fs = demo_store.features(res.name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(res.name).data[:])
    per_block: dict[int, int] = {}
    for name, block, _ in commits(commit_log):
        assert name == res.name
        per_block[block] = per_block.get(block, 0) + 1
    assert sorted(per_block) == list(range(n_blocks))
    assert per_block == {b: 1 for b in range(n_blocks)}, per_block   # each block on disk exactly once
    assert sum(1 for _, _, job in commits(commit_log) if job == cancelled) >= committed_before


CLI = ["-c", "import sys; from vsekit.cli import main; sys.exit(main())"]


def _cli_extract(store, cluster: str, tmp_path: Path, device: str = "cpu") -> subprocess.Popen:
    """``vsekit extract`` of OPTS in its own process (its environment: this test's, SLURM included)."""
    args = [sys.executable, *CLI, "extract", "--store", str(store.path), "--model", "test_resnet", "--kind",
            "fne", "--weights", "none", "--seed", "3", "--input-size", "64", "--resize", "72",
            "--batch-size", "2", "--block-rows", "2", "--device", device, "--cluster", cluster, "--no-progress"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.err", "w"),
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _wait_for_commit(log: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not commits(log):
        time.sleep(0.05)
    assert proc.poll() is None and commits(log), "no block was committed while the run was going"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_signal_to_the_driver_stops_the_run_cancels_its_jobs_and_keeps_rows(
        on_slurm, commit_log, demo_store, tmp_path, sig, code):
    """Findings 4 and 5: Ctrl-C exits 130 and SIGTERM 143, each with the kept-rows line; the run's
    jobs leave the queue within 30 s, the lock is released, nothing is committed afterwards, and
    the kept rows are exactly the logged commits (rerunning resumes from them)."""
    from vsekit.storage.lock import lock_path

    env = on_slurm["env"]
    proc = _cli_extract(demo_store, "slurm:2", tmp_path)
    _wait_for_commit(commit_log, proc)
    ours = set(_squeue(env))
    proc.send_signal(sig)
    _, _ = proc.communicate(timeout=60)
    gone_at = time.time()
    err = (tmp_path / "driver.err").read_text()
    assert proc.returncode == code, err[-3000:]
    assert "interrupted: kept" in err and "rerun the same command to resume" in err
    assert "Traceback" not in err
    while time.time() < gone_at + 30 and ours & set(_squeue(env)):
        time.sleep(0.5)
    assert not ours & set(_squeue(env)), "the run's SLURM jobs were not cancelled"
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    time.sleep(3)   # a worker still running a batch would commit it now
    logged = commits(commit_log)
    assert all(float(ln.split()[4]) <= gone_at for ln in commit_log.read_text().splitlines())
    done = int((demo_store.features("test_resnet_fne").status[:] == 1).sum())
    assert done == 2 * len(logged)   # the kept rows are what was committed, once each
    assert f"kept {done} done" in err


def test_workers_commit_nothing_once_the_driver_is_killed(on_slurm, commit_log, demo_store, tmp_path):
    """Finding 5: the driver killed outright (SIGKILL: nothing cancels its jobs) — the workers that
    are still running tasks must not commit them: the lock they check is no longer held."""
    env, ours = on_slurm["env"], set()
    proc = _cli_extract(demo_store, "slurm:2", tmp_path)
    try:
        _wait_for_commit(commit_log, proc)
        ours = set(_squeue(env))
        proc.kill()
        proc.wait(30)
        killed_at = time.time()
        time.sleep(6)   # in-flight batches (0.4 s each) finish and reach their commit
        late = [ln for ln in commit_log.read_text().splitlines() if float(ln.split()[4]) > killed_at + 0.5]
        assert not late, f"committed after the driver was killed: {late}"
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run([slurm_local.which("scancel"), *sorted(ours)], env=env, capture_output=True)


def _set_config(monkeypatch, **changes):
    cfg = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    cfg.update(changes)
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps(cfg))


@pytest.mark.parametrize("config, device, says", [
    ({"queue": "nosuchpartition"}, "cpu", "partition"),
    ({}, "cuda", "gres"),   # --device cuda on this GPU-less machine: gpus 1, and the node has no GRES
], ids=["partition", "gres"])
def test_refused_submission_is_one_error_line_and_leaves_nothing(on_slurm, demo_store, tmp_path, monkeypatch,
                                                                  config, device, says):
    """Findings 3 and 6: a job SLURM refuses is sbatch's own message in one ``Error:`` line, at once,
    with no traceback; the lock is released and no empty set is left. ``--device cuda`` is not
    checked on this (login) node: the refusal comes from SLURM, about the GPU it lacks."""
    from vsekit.storage import FeatureStore
    from vsekit.storage.lock import lock_path

    _set_config(monkeypatch, **config)
    proc = _cli_extract(demo_store, "slurm:2", tmp_path, device=device)
    try:
        proc.communicate(timeout=120)   # the old code hung here
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "driver.err").read_text()
    assert proc.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: --cluster slurm:2: SLURM refuses the job:"), err
    assert says in lines[0].lower() and "sbatch" in lines[0].lower()
    assert "--device" not in lines[0]
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    assert not FeatureStore.open(demo_store.path).has_features("test_resnet_fne")
    assert not _squeue(on_slurm["env"])


def test_jobs_that_never_start_end_in_an_error_with_squeue_reason(on_slurm, demo_store, monkeypatch):
    """A bounded wait: jobs still pending after ``start_timeout`` stop the run with squeue's reason
    (here BeginTime: the jobs may not start for an hour), cancelled, the lock released."""
    from vsekit.extract import extract
    from vsekit.storage.lock import lock_path

    _set_config(monkeypatch, job_extra=["--begin=now+3600"], start_timeout=8)
    with pytest.raises(ValueError, match=r"no SLURM job started within 8 s .*PENDING \(BeginTime\)"):
        extract(demo_store, cluster="slurm:1", **OPTS)
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    assert not demo_store.has_features("test_resnet_fne")
    assert not _squeue(on_slurm["env"])


def test_jobs_past_their_walltime_are_replaced_and_the_run_completes(on_slurm, commit_log, demo_store, reference,
                                                                     monkeypatch):
    """Finding 2: walltime 1 minute and about two minutes of work (every batch sleeps 10 s) on
    slurm:2. Workers retire before their walltime (--lifetime), adapt submits new jobs, and the run
    completes bit-equal to the in-process one, every block committed once. The old code hung
    forever once both jobs hit TIMEOUT."""
    from vsekit.extract import extract

    _set_config(monkeypatch, walltime="00:01:00")
    monkeypatch.setenv("VSEKIT_TEST_BATCH_DELAY", "10")
    result: dict = {}

    def run():
        try:
            result["res"] = extract(demo_store, cluster="slurm:2", **OPTS)
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
    n_blocks = len(fs.blocks())
    per_block: dict[int, int] = {}
    for _, block, _ in commits(commit_log):
        per_block[block] = per_block.get(block, 0) + 1
    assert per_block == {b: 1 for b in range(n_blocks)}, per_block
    assert len({job for _, _, job in commits(commit_log)}) >= 3   # jobs were replaced along the way
