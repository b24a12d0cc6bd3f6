"""``vsekit extract --cluster slurm-array:N``: a job array whose tasks claim blocks from the store.

Two sets of tests:

* without SLURM: ``sbatch`` and ``squeue`` are stand-in scripts on the PATH and the array's tasks are
  started here as the processes SLURM would start (``python -m vsekit.extract.array SPEC`` with
  ``SLURM_ARRAY_TASK_ID``); one task is killed with SIGKILL while it holds a lease after it committed
  a block, one gets SIGTERM (what SLURM sends at the time limit) mid-block;
* on a real single-node SLURM (tests/slurm_local.py): 3 array tasks, one cancelled with ``scancel``
  after it committed a block while it holds a lease, one past its time limit with a block in progress
  (the one-minute walltime brought forward once the third task has done the rest); the same command
  run again after the array has ended fills the gap.

Commits are counted from the store's own commit: a ``sitecustomize`` module on the tasks' path wraps
``FeatureSet.write_block`` and appends one line per completed block write to a file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

SRC = str(Path(__file__).resolve().parents[1] / "src")
NAME = "test_resnet_fne"
OPTS = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
            crops=1, batch_size=2, block_rows=2, progress=False, device="cpu")

SITECUSTOMIZE = '''
import os
if os.environ.get("VSEKIT_TEST_COMMITS"):
    from vsekit.storage import store as _store
    _write_block = _store.FeatureSet.write_block

    def write_block(self, block, *args, **kwargs):
        _write_block(self, block, *args, **kwargs)
        index = block if isinstance(block, int) else block.index
        fd = os.open(os.environ["VSEKIT_TEST_COMMITS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"{self.name} {index} {os.environ.get('SLURM_ARRAY_TASK_ID', '-')} {os.getpid()}\\n".encode())
        os.close(fd)

    _store.FeatureSet.write_block = write_block
'''


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir):
    """The in-process extraction every array result must equal bit for bit."""
    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy

    torch.set_num_threads(1)
    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir,
                               tmp_path_factory.mktemp("ref") / "ref.zarr")
    res = extract(store, workers=0, **OPTS)
    assert res.done == store.n_images
    return store


def commits(log: Path) -> dict[int, list[str]]:
    """Block index → the tasks that committed it, from the commit log."""
    out: dict[int, list[str]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            name, index, task, _pid = line.split()
            if name == NAME:
                out.setdefault(int(index), []).append(task)
    return out


def leases_of(store_path, task: str) -> list[int]:
    from vsekit.storage.job_arrays import array_dir
    from vsekit.storage.leases import LeaseDir

    return [s.key for s in LeaseDir(array_dir(store_path, NAME) / "leases").states() if str(s.owner.get("task")) == task]


def wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture()
def counted(tmp_path, monkeypatch):
    """A commit log, written by every process started from here on (sitecustomize on PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "commits.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), SRC, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("VSEKIT_TEST_COMMITS", str(log))
    return log


@pytest.fixture()
def fake_slurm(tmp_path, monkeypatch):
    """``sbatch`` that records the script and answers job 4242; ``squeue`` that says it has ended."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sbatch").write_text(f'#!/bin/bash\ncp "${{@: -1}}" {tmp_path}/submitted.sh\necho 4242\n')
    (bin_ / "squeue").write_text("#!/bin/bash\necho 'slurm_load_jobs error: Invalid job id specified' >&2\n"
                                 "exit 1\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("VSEKIT_CLUSTER_CONFIG", raising=False)
    return tmp_path


def hold_tasks(folder: Path, go: Path) -> dict[str, str]:
    """Fault points of the array tasks (vsekit.storage.faults): task 0 holds the lease of its second
    block, task 1 of its first (until killed or its time limit), task 2 starts once ``go`` exists."""
    never = folder / "never"
    return {"VSEKIT_PAUSE": f"array-task-0:claimed@2={never},array-task-1:claimed={never},"
                            f"array-task-2:start={go}",
            "VSEKIT_PAUSE_MAX_S": "900"}


@pytest.mark.slow
def test_array_tasks_killed_and_terminated_mid_block_complete_the_set_once_each(
        demo_store, reference, counted, fake_slurm, monkeypatch):
    from vsekit.extract import extract
    from vsekit.storage import FeatureStore
    from vsekit.storage.job_arrays import array_dir
    from vsekit.storage.info import describe

    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "4")
    sub = extract(demo_store, cluster="slurm-array:3", **OPTS)
    assert sub.job_id == "4242" and sub.pending_blocks == 12
    script = (fake_slurm / "submitted.sh").read_text()
    assert "#SBATCH --array=0-2" in script and "-m vsekit.extract.array" in script
    spec = array_dir(demo_store.path, NAME) / "spec.json"
    assert json.loads(spec.read_text())["job_id"] == "4242"

    go = fake_slurm / "go"    # task 2 starts once task 0 was killed and task 1 holds a block
    env = dict(os.environ, SLURM_ARRAY_JOB_ID="4242", **hold_tasks(fake_slurm, go),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "vsekit.extract.array", str(spec)],
                              env=dict(env, SLURM_ARRAY_TASK_ID=str(k))) for k in range(3)]
    try:
        # task 0: committed a block and holds the lease of its next one -> killed outright
        wait_for(lambda: any("0" in t for t in commits(counted).values()) and leases_of(demo_store.path, "0"),
                 120, "task 0 to commit a block and hold another")
        held = leases_of(demo_store.path, "0")
        procs[0].send_signal(signal.SIGKILL)
        # task 1: holds a lease mid-block -> SIGTERM, as SLURM at the time limit
        wait_for(lambda: leases_of(demo_store.path, "1"), 60, "task 1 to hold a lease")
        go.touch()
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(60) == 143
        assert not leases_of(demo_store.path, "1")          # released, not left to expire
        assert procs[2].wait(180) == 0
        assert procs[0].wait(10) == -signal.SIGKILL
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    fs = FeatureStore.open(demo_store.path).features(NAME)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(NAME).data[:])   # bit for bit
    done = commits(counted)
    assert sorted(done) == list(range(12)) and all(len(t) == 1 for t in done.values())  # each once
    assert done[held[0]] == ["2"]                 # the killed task's block, taken over by task 2
    assert any(t == ["0"] for t in done.values())
    text = describe(FeatureStore.open(demo_store.path), NAME)
    assert "SLURM job array 4242 (3 tasks): ended" in text
    assert "blocks: 12 done, 0 pending of 12" in text and "leases: 0 live" in text
    from vsekit.storage.lock import holder   # the one takeover rule: an ended array's lock until it expires

    wait_for(lambda: holder(demo_store.path, NAME) is None, 60, "the ended array's lock to expire")
    again = extract(demo_store, cluster="slurm-array:3", **OPTS)   # the same command: nothing left
    assert again.job_id is None and "nothing left to extract" in again.summary()
    assert sum(len(t) for t in commits(counted).values()) == 12


def test_a_refused_sbatch_is_one_error_line_and_leaves_nothing(demo_store, fake_slurm):
    from click.testing import CliRunner

    from vsekit.cli import main
    from vsekit.storage import FeatureStore
    from vsekit.storage.lock import lock_path

    (fake_slurm / "bin" / "sbatch").write_text(
        "#!/bin/bash\necho 'sbatch: error: invalid partition specified: nope' >&2\n"
        "echo 'sbatch: error: Batch job submission failed: Invalid partition name specified' >&2\nexit 1\n")
    res = CliRunner().invoke(main, ["extract", "--store", str(demo_store.path), "--model", "test_resnet",
                                    "--kind", "fne", "--weights", "none", "--input-size", "64",
                                    "--device", "cpu", "--cluster", "slurm-array:2", "--no-progress"])
    assert res.exit_code == 1
    out = res.output.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("Error: --cluster slurm-array:2: sbatch refused")
    assert "Invalid partition name specified" in out[0]
    assert not FeatureStore.open(demo_store.path).has_features(NAME)  # no empty set
    assert not lock_path(demo_store.path, NAME).exists()              # lock released
    assert not (Path(demo_store.path) / ".vsekit" / "arrays" / NAME / "spec.json").exists()


def test_a_running_array_holds_the_set_against_other_writers(demo_store, fake_slurm, monkeypatch):
    """While squeue lists the array, another extract of the same set is refused; once it has
    left the queue and the lock has expired (the one takeover rule of every guard, as the set's lease
    on object storage: a task still ending would renew it), the next run proceeds."""
    from vsekit.extract import extract
    from vsekit.storage.lock import LockHeld, lock_path

    extract(demo_store, cluster="slurm-array:2", **OPTS)
    (fake_slurm / "bin" / "squeue").write_text("#!/bin/bash\necho RUNNING\n")
    with pytest.raises(LockHeld, match="slurm-array"):
        extract(demo_store, workers=0, **OPTS)
    lock = lock_path(demo_store.path, NAME)
    old = time.time() - 7200
    os.utime(lock, (old, old))                        # expired, but squeue lists the job: still the array's
    with pytest.raises(LockHeld, match="SLURM job array 4242 .*scancel 4242"):
        extract(demo_store, workers=0, **OPTS)
    (fake_slurm / "bin" / "squeue").write_text("#!/bin/bash\necho 'Invalid job id specified' >&2\nexit 1\n")
    os.utime(lock)                                    # the job has left the queue, its lock is fresh
    with pytest.raises(LockHeld, match="its job has ended and its lease expires in"):
        extract(demo_store, workers=0, **OPTS)
    os.utime(lock, (old, old))                        # ... and now expired: the next run takes the set
    res = extract(demo_store, workers=0, **OPTS)
    assert res.done == demo_store.n_images


def test_job_script_carries_the_slurm_settings(tmp_path):
    from vsekit.extract.array import job_script
    from vsekit.schedulers.slurm import mem_mb

    s = job_script(tmp_path / "spec.json", "vgg19 fne", 8,
                   {"queue": "gpu", "account": "proj", "walltime": "04:00:00", "cores": 8,
                    "memory": "32GB", "gpus": 1, "job_extra": ["--constraint=a100"],
                    "prologue": ["module load cuda"], "python": "/opt/py/bin/python"},
                   "cuda", tmp_path / "logs")
    for line in ("#SBATCH --array=0-7", "#SBATCH --cpus-per-task=8", f"#SBATCH --mem={mem_mb('32GB')}M",
                 "#SBATCH -p gpu", "#SBATCH -A proj", "#SBATCH -t 04:00:00", "#SBATCH --gres=gpu:1",
                 "#SBATCH --constraint=a100", "module load cuda",
                 f"exec /opt/py/bin/python -m vsekit.extract.array {tmp_path / 'spec.json'}"):
        assert line in s.splitlines()
    assert "--gres" not in job_script(tmp_path / "s.json", "x", 2, {}, "cpu", tmp_path)
    assert mem_mb("32GB") == 30518 and mem_mb("2GiB") == 2048 and mem_mb("4000MB") == 3815


# --- on a real single-node SLURM -------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node SLURM on 127.0.0.1 (tests/slurm_local.py); yields its clients' environment."""
    pytest.importorskip("dask_jobqueue", reason="dask-jobqueue not installed (pip install 'vsekit[slurm]')")
    import slurm_local

    why = slurm_local.unavailable()
    if why:
        pytest.skip(why)
    with slurm_local.local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def _array_entries(env, job: str) -> list[str]:
    import slurm_local

    return [j for j in slurm_local.jobs(env) if j.split("_")[0] == job]


@pytest.mark.slow
def test_on_slurm_a_cancelled_and_a_timed_out_task_then_the_rerun_complete_every_block_once(
        slurm, demo_store, reference, counted, tmp_path, monkeypatch):
    import slurm_local

    from vsekit.extract import extract
    from vsekit.storage import FeatureStore
    from vsekit.storage.info import describe

    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    logs = tmp_path / "jobs"
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({
        "cores": 1, "memory": "1GB", "walltime": "00:01:00", "queue": "vsekit", "python": sys.executable,
        "log_directory": str(logs)}))
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "10")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # task 0 commits one block, then holds the next; task 1 holds its first block past the time limit
    # task 2 starts once task 0 is cancelled (else it could do every block before task 0 starts)
    go = tmp_path / "go"
    for key, value in hold_tasks(tmp_path, go).items():
        monkeypatch.setenv(key, value)
    t0 = time.time()
    sub = extract(demo_store, cluster="slurm-array:3", **OPTS)
    job = sub.job_id
    assert job and sub.tasks == 3 and sub.pending_blocks == 12

    def held_by_task_0() -> list[int]:   # a lease on a block it has not committed (not the one just done)
        done = commits(counted)
        return [b for b in leases_of(demo_store.path, "0") if b not in done] if any(
            "0" in t for t in done.values()) else []

    held = wait_for(held_by_task_0, 240, "array task 0 to commit a block and hold another")
    subprocess.run([slurm_local.which("scancel"), f"{job}_0"], env=slurm, check=True)
    go.touch()
    text = wait_for(lambda: "leases:" in (t := describe(FeatureStore.open(demo_store.path), NAME)) and t, 5,
                    "vsekit info")
    assert f"SLURM job array {job} (3 tasks): queued or running" in text
    # once task 2 has done the rest (it then waits for task 1's lease), tasks 1 and 2 go past their
    # time limit together: SLURM's own TIME LIMIT end, brought forward from the one-minute walltime
    wait_for(lambda: len(commits(counted)) + len(leases_of(demo_store.path, "1")) == 12, 300,
             "task 2 to commit every block but the one task 1 holds")
    slurm_local.time_out(slurm, f"{job}_1", f"{job}_2")
    wait_for(lambda: not _array_entries(slurm, job), 400, f"array {job} to end")
    first_array_s = time.time() - t0
    out = {str(k): (logs / f"vsekit-{NAME}-{job}_{k}.out").read_text() for k in range(3)}
    assert "CANCELLED AT" in out["0"] and "TIME LIMIT" not in out["0"]   # scancel
    assert "DUE TO TIME LIMIT" in out["1"]                               # past its walltime
    assert "terminated (SIGTERM)" in out["1"]
    done_first = commits(counted)
    assert "0" in sum(done_first.values(), []) and held[0] not in [b for b, t in done_first.items() if "0" in t]

    monkeypatch.delenv("VSEKIT_PAUSE")
    from vsekit.storage.lock import holder

    # the one takeover rule: the ended array's lock is kept until it expires (one ttl after the last refresh)
    wait_for(lambda: holder(demo_store.path, NAME) is None, 60, "the ended array's lock to expire")
    t1 = time.time()
    again = extract(demo_store, cluster="slurm-array:3", **OPTS)       # the same command fills the gap
    if again.job_id is not None:
        wait_for(lambda: not _array_entries(slurm, again.job_id), 300, f"array {again.job_id} to end")
    rerun_s = time.time() - t1
    fs = FeatureStore.open(demo_store.path).features(NAME)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images, "failed": 0}
    assert np.array_equal(fs.data[:], reference.features(NAME).data[:])   # bit for bit
    done = commits(counted)
    assert sorted(done) == list(range(12)) and all(len(t) == 1 for t in done.values())  # each once
    wait_for(lambda: holder(demo_store.path, NAME) is None, 60, "the ended array's lock to expire")
    final = extract(demo_store, cluster="slurm-array:3", **OPTS)
    assert final.job_id is None                                          # a finished set reports done
    print(f"\nfirst array {first_array_s:.0f}s (gap left: {12 - len(done_first)} blocks), "
          f"rerun {rerun_s:.0f}s (job {again.job_id})")


def test_failure_reasons_written_by_array_tasks_reach_the_set(demo_store, fake_slurm):
    """A task records a bad image's reason beside the block; it is merged into the set's attrs."""
    from vsekit.extract import extract
    from vsekit.extract.array import work
    from vsekit.storage import FeatureStore
    from vsekit.storage.job_arrays import array_dir

    paths = demo_store.root["images/path"]
    paths[5] = "no/such/image.jpg"
    sub = extract(demo_store, cluster="slurm-array:1", **OPTS)
    assert work(array_dir(demo_store.path, NAME) / "spec.json", task=0) == 0
    fs = FeatureStore.open(demo_store.path).features(NAME)
    assert fs.counts() == {"pending": 0, "done": demo_store.n_images - 1, "failed": 1}
    assert list(fs.errors()) == [5] and fs.errors()[5].startswith("missing file")
    assert not list((array_dir(demo_store.path, NAME) / "errors").glob("*.json"))
    assert sub.job_id == "4242"


def test_a_task_commits_nothing_once_the_array_lost_the_sets_lock(demo_store, fake_slurm, monkeypatch):
    """Another run takes the set's lock (VSEKIT_BREAK_LOCK=1) while a task extracts its first block:
    the task stops without committing it (nothing reaches the status)."""
    from vsekit.extract import array
    from vsekit.extract import extract
    from vsekit.storage import FeatureStore
    from vsekit.storage.job_arrays import array_dir
    from vsekit.storage.lock import lock_path

    extract(demo_store, cluster="slurm-array:1", **OPTS)
    path = lock_path(demo_store.path, NAME)
    compute = array.compute_block

    def compute_then_lose_the_lock(*args, **kwargs):
        buf = compute(*args, **kwargs)
        path.write_text(json.dumps(dict(json.loads(path.read_text()), token="another-run")))
        return buf

    monkeypatch.setattr(array, "compute_block", compute_then_lose_the_lock)
    assert array.work(array_dir(demo_store.path, NAME) / "spec.json", task=0) == 2
    assert FeatureStore.open(demo_store.path).features(NAME).counts()["done"] == 0


def test_slurm_array_spec_is_parsed_and_refused_outside_extract():
    from vsekit.clusters import cluster_client, parse_cluster

    spec = parse_cluster("slurm-array:16", {})
    assert (spec.kind, spec.n, spec.is_array) == ("slurm-array", 16, True)
    for bad in ("slurm-array:0", "slurm-array:x", "slurm-array:"):
        with pytest.raises(ValueError, match="slurm-array:N with N >= 1"):
            parse_cluster(bad)
    pytest.importorskip("distributed")
    with pytest.raises(ValueError, match="job arrays run `vsekit extract` only"):
        with cluster_client("slurm-array:2"):
            pass


def test_overwrite_with_an_array_replaces_the_finished_set(demo_store, reference, fake_slurm):
    """``--overwrite`` of a finished set through a job array: the tasks fill the set that the command
    names (no driver stays to swap a set built beside it), equal to a fresh in-process extraction."""
    from vsekit.extract import extract
    from vsekit.extract.array import work
    from vsekit.storage import FeatureStore
    from vsekit.storage.job_arrays import array_dir

    first = extract(demo_store, workers=0, **{**OPTS, "seed": 4})   # other weights: other bits
    assert first.done == demo_store.n_images
    extract(demo_store, cluster="slurm-array:1", overwrite=True, **OPTS)
    assert work(array_dir(demo_store.path, NAME) / "spec.json", task=0) == 0
    store = FeatureStore.open(demo_store.path)
    fs = store.features(NAME)
    assert fs.counts()["done"] == demo_store.n_images
    np.testing.assert_array_equal(fs.data[:], reference.features(NAME).data[:])
    assert not [p.name for p in (store.path / "features").iterdir() if p.name.startswith(f".{NAME}.")]


@pytest.mark.parametrize("scheduler, submit, env", [
    ("sge", "qsub", {"JOB_ID": "4243", "SGE_TASK_ID": "2"}),                       # qsub -t 1-2: tasks 1, 2
    ("slurm", "sbatch", {"SLURM_ARRAY_JOB_ID": "4243", "SLURM_ARRAY_TASK_ID": "1"}),  # --array=0-1: 0, 1
])
def test_an_array_task_is_named_as_its_scheduler_numbers_it(demo_store, fake_slurm, monkeypatch, capsys,
                                                            scheduler, submit, env):
    """The last task of a 2-task array (Grid Engine's task 2, SLURM's task 1) says that number in its
    log and its lease records, the number ``qdel JOB -t 2`` / ``scancel JOB_1`` takes, and starts
    halfway through the blocks as the second of two tasks (a Grid Engine task 2 once said "task 1").
    """
    from vsekit.extract import extract
    from vsekit.extract.array import work
    from vsekit.storage.job_arrays import array_dir
    from vsekit.storage.leases import owner_record

    (fake_slurm / "bin" / submit).write_text(f'#!/bin/bash\ncp "${{@: -1}}" {fake_slurm}/submitted.sh\necho 4243\n')
    (fake_slurm / "bin" / submit).chmod(0o755)
    sub = extract(demo_store, cluster=f"{scheduler}-array:2", **OPTS)
    script = (fake_slurm / "submitted.sh").read_text()
    assert ("#$ -t 1-2" if scheduler == "sge" else "#SBATCH --array=0-1") in script.splitlines()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    task = env.get("SGE_TASK_ID") or env["SLURM_ARRAY_TASK_ID"]
    assert owner_record()["job"] == "4243" and owner_record()["task"] == task
    capsys.readouterr()
    assert work(array_dir(demo_store.path, NAME) / "spec.json") == 0
    log = capsys.readouterr().err
    assert f"vsekit array task: task {task} of job 4243 on " in log, log
    committed = [int(ln.split("committed block ")[1].split()[0]) for ln in log.splitlines() if "committed block " in ln]
    assert sorted(committed) == list(range(sub.blocks))
    assert committed[0] == sub.blocks // 2   # the second of two tasks starts halfway
