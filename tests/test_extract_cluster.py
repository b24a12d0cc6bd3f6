"""Extraction on dask: ``--cluster local:2`` and ``--cluster tcp://`` against a scheduler and two
workers started here, one of them killed mid-run. The output must equal an in-process run bit for
bit (CPU, fp32) and every row block must be reported done exactly once."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("distributed")

# each starts a dask cluster (local processes or a TCP scheduler) and most kill a worker: the slow set
pytestmark = pytest.mark.slow

from vsekit.extract import extract  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

BIN = Path(sys.executable).parent
OPTS = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
            crops=1, batch_size=2, block_rows=2, progress=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir):
    """An in-process run with 1 torch thread (dask workers run single-threaded too)."""
    from vsekit.storage.sources.karpathy import ingest_karpathy

    torch.set_num_threads(1)
    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir,
                               tmp_path_factory.mktemp("ref") / "ref.zarr")
    res = extract(store, workers=0, **OPTS)
    assert res.done == store.n_images and res.failed == 0
    return store.features(res.name).data[:]


def test_local_cluster_matches_in_process(demo_store, reference):
    res = extract(demo_store, cluster="local:2", **OPTS)
    fs = demo_store.features(res.name)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference)  # bit for bit
    assert sorted(res.block_runs) == [b.index for b in fs.blocks()]
    assert set(res.block_runs.values()) == {1}
    assert res.model_builds and set(res.model_builds.values()) == {1}  # one model per worker process
    # a rerun finds everything done and submits nothing
    again = extract(demo_store, cluster="local:2", **OPTS)
    assert again.blocks_run == 0 and again.blocks_skipped == len(fs.blocks())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, log, env=None):
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@contextlib.contextmanager
def tcp_cluster(log_path: Path, workers: int = 1, env: dict | None = None):
    """A dask scheduler and ``workers`` single-threaded workers on loopback, as a user starts them
    (``dask scheduler``, ``dask worker``; ``env``: their environment, else this process's); yields the
    scheduler's address and the processes (scheduler first), and stops them all after."""
    from distributed import Client

    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    log = open(log_path, "w")
    procs = [_start([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                     "--no-dashboard"], log, env)]
    try:
        time.sleep(2)
        for _ in range(workers):
            procs.append(_start([str(BIN / "dask"), "worker", addr, "--nthreads", "1", "--no-nanny",
                                 "--no-dashboard", "--host", "127.0.0.1"], log, env))
        with Client(addr, timeout=60) as c:
            c.wait_for_workers(workers, timeout=60)
        yield addr, procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:   # a worker stuck closing its comms
                os.killpg(p.pid, signal.SIGKILL)
        log.close()


def test_tcp_cluster_survives_a_killed_worker(demo_store, reference, tmp_path):
    with tcp_cluster(tmp_path / "dask.log", workers=2) as (addr, procs):
        result: dict = {}

        def run():
            try:
                result["res"] = extract(demo_store, cluster=addr, **OPTS)
            except BaseException as exc:  # surfaced below
                result["exc"] = exc

        t = threading.Thread(target=run)
        t.start()
        name = "test_resnet_fne"
        deadline = time.time() + 120
        while time.time() < deadline:  # kill worker 1 once some blocks, not all, are done
            try:
                status = FeatureStore.open(demo_store.path).features(name).status[:]
            except (KeyError, Exception):  # the set is being created
                status = None
            if status is not None and 2 <= int((status != 0).sum()) < len(status) - 4:
                break
            time.sleep(0.05)
        victim = procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        t.join(180)
        assert not t.is_alive()
        if "exc" in result:
            raise result["exc"]
        res = result["res"]
        fs = demo_store.features(res.name)
        assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
        assert np.array_equal(fs.data[:], reference)
        assert sorted(res.block_runs) == [b.index for b in fs.blocks()]
        assert set(res.block_runs.values()) == {1}  # every block reported done exactly once


def _isolate_the_bad_image(demo_store, reference, monkeypatch, capfd, config: dict) -> tuple[dict, dict]:
    """Extract on ``local:2`` under the dask ``config`` with one file whose decoding ends its worker
    process (test hook; a codec segfault or the OOM killer in real life). Returns what the run left on
    disk and on stderr, and what it must be: the run does not fail with KilledWorker; its block is
    bisected, that one row is marked failed with the reason, every other row is extracted, and the
    deaths are reported."""
    import dask

    paths = [str(p) for p in demo_store.root["images/path"][:]]
    bad_row = 5
    # the fault point each decoded file passes: the process decoding this one ends there (os._exit)
    monkeypatch.setenv("VSEKIT_FAULT", "decode:" + paths[bad_row].rsplit("/", 1)[-1])
    opts = dict(OPTS, block_rows=4)
    with dask.config.set({"distributed.scheduler.allowed-failures": 1, **config}):
        res = extract(demo_store, cluster="local:2", **opts)
    fs = demo_store.features(res.name)
    status, data = fs.status[:], fs.data[:]
    ok = status == 1
    err = capfd.readouterr().err
    seen = {
        "failed rows": np.flatnonzero(status == 2).tolist(),
        "extracted rows": int(ok.sum()),
        "error rows": list(res.errors),
        "reason says killed": "killed" in res.errors.get(bad_row, ""),
        "errors on disk": fs.errors() == res.errors,
        # rows bisected out of their batch may run at another batch size: equal up to float rounding
        "features as the reference": bool(np.allclose(data[ok], reference[ok], rtol=1e-4, atol=1e-5)),
        "bad row zeros": not data[bad_row].any(),
        "blocks done once": (sorted(res.block_runs), set(res.block_runs.values())),
        "bisection reported": "killed the dask workers" in err and f"row {bad_row}:" in err,
        "deaths reported": "died during the run" in err,
    }
    want = dict(seen, **{"failed rows": [bad_row], "extracted rows": demo_store.n_images - 1,
                         "error rows": [bad_row], "reason says killed": True, "errors on disk": True,
                         "features as the reference": True, "bad row zeros": True,
                         "blocks done once": ([b.index for b in fs.blocks()], {1}),
                         "bisection reported": True, "deaths reported": True})
    return seen, want


def test_image_that_kills_every_worker_is_isolated_and_marked_failed(demo_store, reference, monkeypatch, capfd):
    seen, want = _isolate_the_bad_image(demo_store, reference, monkeypatch, capfd, {})
    assert seen == want


@pytest.mark.timeout(600)   # a hang fails here (the run itself: up to ~330 s at load average 16)
def test_a_worker_restart_slower_than_the_lost_worker_timeout_keeps_its_nanny(demo_store, reference, monkeypatch,
                                                                             capfd):
    """The hang of a loaded machine, made certain: dask's lost-worker reaper closes a worker's nanny
    for good when no worker of its name is up lost-worker-timeout (15 s) after a death; on a busy node
    a nanny restarting its worker at that moment was closed, and with both gone the bisection waited
    forever on tasks no worker would run. Here the timeout is shorter than any restart: a local
    cluster's nannies must still restart their workers (clusters/local.py, local_config)."""
    seen, want = _isolate_the_bad_image(demo_store, reference, monkeypatch, capfd,
                                        {"distributed.deploy.lost-worker-timeout": "0.05s"})
    assert seen == want


@pytest.mark.timeout(600)   # a hang fails here (the run itself: up to ~330 s at load average 16)
@pytest.mark.parametrize("allowed_failures", [1, 3], ids=["in-the-bisection", "in-the-blocks"])
def test_a_cluster_whose_workers_are_all_gone_ends_the_run_with_one_error(demo_store, tmp_path, allowed_failures):
    """Every worker of ``local:2`` gone and not coming back (a preload makes each nanny give up on its
    first restart; the bad image kills both workers): after dask's no-workers-timeout the run ends with
    one ``Error:`` line saying what happened and what was kept, exit 1, the committed blocks kept and
    the lock released; never a hang. With allowed-failures 1 the wait is in the bisection of the bad
    image's block, with 3 in the blocks' own loop."""
    from vsekit.storage.lock import lock_path

    bad = str(demo_store.root["images/path"][5]).rsplit("/", 1)[-1]
    (tmp_path / "started").mkdir()
    preload = Path(__file__).resolve().parent / "dask_preload" / "no_restart.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", VSEKIT_FAULT=f"decode:{bad}",
               VSEKIT_TEST_STARTED=str(tmp_path / "started"),
               DASK_DISTRIBUTED__WORKER__PRELOAD=f"[{str(preload)!r}]",
               DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT="3s",
               DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=str(allowed_failures))
    args = [sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())", "extract",
            "--store", str(demo_store.path), "--model", "test_resnet", "--kind", "fne", "--weights", "none",
            "--input-size", "64", "--resize", "72", "--batch-size", "2", "--block-rows", "4", "--device", "cpu",
            "--cluster", "local:2", "--no-progress"]
    proc = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=570)
    err = proc.stderr
    assert proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err[-3000:]
    # no traceback through vsekit (dask's nanny logs the restart that the preload cut short)
    assert not [ln for ln in err.splitlines() if ln.strip().startswith('File "') and "vsekit" in ln], err[-3000:]
    assert "--cluster local:2: no dask worker could run the pending tasks for 3 s" in errors[0]
    assert sorted(p.name for p in (tmp_path / "started").iterdir()) == ["vsekit-0", "vsekit-1"]
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    after = FeatureStore.open(demo_store.path)   # a new set with nothing done is removed (extract/runner.py)
    kept = after.has_features("test_resnet_fne")
    status = after.features("test_resnet_fne").status[:] if kept else np.zeros(demo_store.n_images)
    done = int((status == 1).sum())
    assert status[5] == 0 and done % 4 == 0   # committed blocks stay, each whole; the bad one never was
    assert f"kept {done} done and 0 failed rows of {demo_store.n_images}" in errors[0]


def test_sigterm_on_local_cluster_exits_143_with_the_kept_rows(demo_store, tmp_path):
    """Finding 5 on ``local:2``: SIGTERM to the driver (a preempted job, a login node's limit) stops
    the run like Ctrl-C: exit 143, the kept-rows line, the lock released, no commit afterwards."""
    from vsekit.storage.lock import lock_path

    log = tmp_path / "commits.log"
    instrument = Path(__file__).resolve().parent / "commit_log"   # its sitecustomize.py logs commits
    env = dict(os.environ, OMP_NUM_THREADS="1", VSEKIT_TEST_COMMIT_LOG=str(log), VSEKIT_TEST_BATCH_DELAY="0.4",
               PYTHONPATH=os.pathsep.join([str(instrument), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())", "extract",
            "--store", str(demo_store.path), "--model", "test_resnet", "--kind", "fne", "--weights", "none",
            "--input-size", "64", "--resize", "72", "--batch-size", "2", "--block-rows", "2", "--device", "cpu",
            "--cluster", "local:2", "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and proc.poll() is None and not (log.exists() and log.read_text()):
            time.sleep(0.05)
        assert proc.poll() is None and log.read_text(), "no block was committed while the run was going"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    gone_at = time.time()
    assert proc.returncode == 143, err[-3000:]
    assert "interrupted: kept" in err and "Traceback" not in err
    assert not lock_path(demo_store.path, "test_resnet_fne").exists()
    time.sleep(2)
    lines = log.read_text().splitlines()
    assert all(float(ln.split()[4]) <= gone_at for ln in lines)
    done = int((FeatureStore.open(demo_store.path).features("test_resnet_fne").status[:] == 1).sum())
    assert done == 2 * len(lines) and f"kept {done} done" in err
