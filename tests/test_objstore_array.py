"""`extract --cluster slurm-array:N` / `sge-array:N` into an ``s3://`` store (issue 35), against the local
S3 server (the ``s3`` fixture).

* default set: the block leases as objects (claim, renewal, takeover only after expiry, a holder
  that lost its lease can neither renew nor release the new holder's), on a logical clock; the set's
  lease handed to the array with a stand-in ``sbatch`` / ``squeue`` (the tasks run here, in-process);
* slow, on the throw-away one-node SLURM and Grid Engine (tests/slurm_local.py, sge_local.py): the
  arrays' results equal the in-process run on disk bit for bit with one commit record per block, the
  ``--storage-option`` secret is in no job script, log, spec or object, another extract is refused
  while the array holds the set, and tasks killed between their chunks and their records are made
  good by the rerun with nothing committed twice; a task cancelled and one past its time limit
  release their blocks and the rerun completes the set; a Grid Engine task deleted while it holds
  a block leaves it to its sibling;
* slow, the tasks started here as the scheduler starts them (stand-in sbatch / squeue): a task
  SIGKILLed with a half block written, whose expired lease a sibling takes over; one SIGTERMed
  mid-block or while it commits; requeued tasks that had written chunks and a record (nothing written
  twice, compared object by object); a task suspended past its lease (it writes nothing on
  resuming); an array whose tasks all died (``vsekit info``, ``vsekit split`` refused while
  the job is listed, the rerun submits the pending blocks only).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_objstore_slow import NAME, OPTS, _ingest, _records_per_block, reference  # noqa: E402,F401
from test_slurm_array import fake_slurm  # noqa: E402,F401
from conftest import wait_until as _wait  # noqa: E402

pytestmark = pytest.mark.e2e

OPTION_SECRET = "vsekit-array-option-secret-not-in-any-file"


# --- the block leases as objects -------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    from vsekit.storage import objleases

    c = Clock()
    monkeypatch.setattr(objleases, "time", c)
    return c


def _dirs(s3, ttl=10.0):
    from vsekit.storage.objleases import ObjectLeaseDir
    from vsekit.storage.objstore import Objects

    objects = Objects(s3.url("leases.zarr"))
    prefix = ".vsekit/arrays/x/leases"
    return (ObjectLeaseDir(objects, prefix, ttl=ttl, owner={"task": "a"}),
            ObjectLeaseDir(objects, prefix, ttl=ttl, owner={"task": "b"}))


def test_an_object_lease_is_claimed_once_renewed_and_taken_over_only_after_it_expired(s3, clock):
    a, b = _dirs(s3)
    la = a.claim(3)
    assert la is not None and la.stolen_from is None
    assert b.claim(3) is None                                  # live: refused
    assert s3.keys(f"leases.zarr/.vsekit/arrays/x/leases/") == ["leases.zarr/.vsekit/arrays/x/leases/b000003.json"]
    clock.now += 8
    a.renew(la)                                                # expiry pushed to now + 10
    clock.now += 8                                             # 16 s after the claim, 8 after the renewal
    assert b.claim(3) is None and a.held(la, margin=1)
    [state] = list(b.states())
    assert (state.key, state.owner["task"], state.expires > clock.now) == (3, "a", True)
    clock.now += 2.5                                           # now past the renewed expiry
    assert not a.held(la, margin=0) and list(b.states())[0].expires < clock.now
    lb = b.claim(3)
    assert lb is not None and lb.stolen_from["task"] == "a" and lb.stolen_from["token"] == la.token
    assert b.claim(3) is None and b.held(lb)


def test_a_holder_that_lost_its_object_lease_cannot_renew_or_release_the_new_holders(s3, clock):
    a, b = _dirs(s3)
    la = a.claim(0)
    clock.now += 11
    lb = b.claim(0)                                            # expired: taken over
    assert lb is not None
    a.renew(la)                                                # compare-and-swap on a's ETag: refused
    assert not a.held(la, margin=0)
    a.release(la)                                              # likewise: b's lease stays
    assert b.state(0).owner["token"] == lb.token and b.held(lb)
    b.renew(lb)
    assert b.held(lb) and a.claim(0) is None
    b.release(lb)                                              # the holder's own release frees it
    assert b.state(0).free and list(b.states()) == []
    lc = a.claim(0)                                            # a free block: claimed at once
    assert lc is not None and lc.stolen_from is None


# --- the set's lease handed to the array (stand-in sbatch and squeue; the task runs here) ---------
def _squeue(folder: Path, running: bool) -> None:
    (folder / "bin" / "squeue").write_text(
        "#!/bin/bash\necho RUNNING\n" if running else
        "#!/bin/bash\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")


def _lease(s3) -> dict:
    return json.loads(s3.client.get_object(Bucket=s3.bucket, Key=f"x.zarr/.vsekit/leases/{NAME}.json")["Body"].read())


def _expire(s3) -> None:
    """What waiting out the lease's ttl does (no task renews it any more), without the wait."""
    key = f"x.zarr/.vsekit/leases/{NAME}.json"
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=json.dumps(dict(_lease(s3), expires=1.0)).encode())


def _secret_options(s3, monkeypatch) -> None:
    from vsekit.storage import objstore

    monkeypatch.setattr(objstore, "DEFAULT_OPTIONS", {"secret_access_key": OPTION_SECRET})


def test_the_array_holds_the_sets_lease_until_its_job_ended_and_its_tasks_commit_under_it(
        s3, demo_dir, fake_slurm, tmp_path, monkeypatch):
    from vsekit.extract import extract
    from vsekit.extract.array import OPTIONS_ENV, work
    from vsekit.storage.info import describe
    from vsekit.storage.objstore import LeaseHeld
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    FeatureStore.open(url, mode="r+").root["images/path"][5] = "no/such/image.jpg"
    (fake_slurm / "bin" / "sbatch").write_text(   # records the script and the environment it was given
        f'#!/bin/bash\ncp "${{@: -1}}" {fake_slurm}/submitted.sh\nenv > {fake_slurm}/sbatch.env\necho 4242\n')
    monkeypatch.chdir(tmp_path)
    _secret_options(s3, monkeypatch)
    sub = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    assert sub.job_id == "4242" and sub.pending_blocks == 6 and sub.tasks == 2
    script = (fake_slurm / "submitted.sh").read_text()
    assert script.splitlines()[-1].endswith(f"-m vsekit.extract.array {url} {NAME}")
    assert Path(sub.log_dir).resolve() == (tmp_path / "vsekit-arrays" / NAME / "logs").resolve()   # local
    spec = json.loads(s3.client.get_object(Bucket=s3.bucket, Key=f"x.zarr/.vsekit/arrays/{NAME}/spec.json")["Body"].read())
    lease = _lease(s3)
    assert (lease["token"], lease["array_job"], lease["array_scheduler"], lease["pid"]) == (
        spec["lock_token"], "4242", "slurm", 0)                 # handed over: the driver's exit frees nothing
    # the option reached sbatch's environment only: not the script, the spec or any object
    assert json.loads(dict(ln.split("=", 1) for ln in (fake_slurm / "sbatch.env").read_text().splitlines()
                           if "=" in ln)[OPTIONS_ENV]) == {"secret_access_key": OPTION_SECRET}
    assert OPTIONS_ENV not in os.environ
    assert OPTION_SECRET not in script and OPTION_SECRET not in json.dumps(spec)
    for key in s3.keys():
        assert OPTION_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key

    _squeue(fake_slurm, running=True)
    with pytest.raises(LeaseHeld, match="SLURM job array 4242"):
        extract(url, **OPTS)
    _expire(s3)                                    # expired, but squeue lists the job: still the array's
    with pytest.raises(LeaseHeld, match="SLURM job array 4242 .*scancel 4242"):
        extract(url, **OPTS)
    text = describe(FeatureStore.open(url), NAME)
    assert "SLURM job array 4242 (2 tasks): queued or running" in text and "blocks: 0 done, 6 pending of 6" in text

    assert work(url, task=0, name=NAME) == 0        # one task does every block (the other never started)
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 23, "failed": 1}
    assert list(fs.errors()) == [5] and fs.errors()[5].startswith("missing file")   # merged from its object
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert {json.loads(s3.client.get_object(Bucket=s3.bucket, Key=k)["Body"].read())["token"]
            for k in s3.keys(f"x.zarr/.vsekit/commits/{NAME}/")} == {spec["lock_token"]}
    assert not s3.keys(f"x.zarr/.vsekit/arrays/{NAME}/errors/")
    _squeue(fake_slurm, running=False)
    with pytest.raises(LeaseHeld, match="its job has ended and its lease expires in"):   # the task renewed it
        extract(url, **OPTS)
    text = describe(FeatureStore.open(url), NAME)
    assert "SLURM job array 4242 (2 tasks): ended" in text
    assert "blocks: 6 done, 0 pending of 6 (1 with failed rows)" in text and "leases: 0 live, 0 expired" in text
    _expire(s3)                                    # ended and expired: the next run takes the set
    again = extract(url, **OPTS)
    assert again.blocks_run == 0 and again.done == 23
    assert not s3.keys(f"x.zarr/.vsekit/leases/")  # released by that run


def test_an_array_task_commits_nothing_once_another_run_took_the_sets_lease(s3, demo_dir, fake_slurm, tmp_path,
                                                                           monkeypatch):
    from vsekit.extract import array, extract
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    extract(url, cluster="slurm-array:1", device="cpu", **OPTS)
    compute = array.compute_block

    def compute_then_lose_the_lease(*args, **kwargs):
        buf = compute(*args, **kwargs)
        key = f"x.zarr/.vsekit/leases/{NAME}.json"
        s3.client.put_object(Bucket=s3.bucket, Key=key, Body=json.dumps(dict(_lease(s3), token="another-run")).encode())
        return buf

    monkeypatch.setattr(array, "compute_block", compute_then_lose_the_lease)
    assert array.work(url, task=0, name=NAME) == 2
    assert FeatureStore.open(url).features(NAME).counts()["done"] == 0
    assert _records_per_block(s3) == {}
    assert not s3.keys(f"x.zarr/features/{NAME}/data/c/")       # refused before its chunks were written


# --- on the local SLURM and Grid Engine ------------------------------------------------------------
def _on_cluster(s3, monkeypatch, tmp_path, config: dict) -> Path:
    """The tasks run this checkout's src; no AWS variable in their environment: the endpoint and the
    credentials reach them only through the option variable sbatch / qsub passes on."""
    from vsekit.storage import objstore

    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({
        "cores": 1, "memory": "1GB", "walltime": "00:20:00", "python": sys.executable, "log_directory": str(jobs),
        **config}))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setattr(objstore, "DEFAULT_OPTIONS", {
        "endpoint": s3.endpoint, "access_key_id": "vsekit-test-key", "secret_access_key": OPTION_SECRET,
        "region": "us-east-1"})
    monkeypatch.chdir(tmp_path)
    return jobs


def _leaks_nothing(s3, folders) -> None:
    written = [p for folder in folders for p in folder.rglob("*") if p.is_file()]
    assert any(p.suffix == ".sh" for p in written) and any(p.suffix != ".sh" for p in written)
    for p in written:
        assert OPTION_SECRET.encode() not in p.read_bytes(), p
    assert any(k.endswith("/spec.json") for k in s3.keys())
    for key in s3.keys():
        assert OPTION_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key


def _slurm_array_ended(env, job: str) -> bool:
    import slurm_local

    return not [j for j in slurm_local.jobs(env) if j.split("_")[0] == job]


@pytest.mark.slow
def test_a_slurm_array_into_s3_equals_disk_holds_the_set_and_leaks_no_storage_option(
        local_slurm, s3, demo_dir, reference, tmp_path, monkeypatch):
    from vsekit.extract import extract
    from vsekit.storage import integrity
    from vsekit.storage.info import describe
    from vsekit.storage.objstore import LeaseHeld
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"queue": "vsekit"})
    go = tmp_path / "go"                      # both tasks wait at their start until the checks below are done
    monkeypatch.setenv("VSEKIT_PAUSE", f"array-task-0:start={go},array-task-1:start={go}")
    monkeypatch.setenv("VSEKIT_PAUSE_MAX_S", "600")
    sub = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    assert sub.job_id and sub.pending_blocks == 6
    with pytest.raises(LeaseHeld, match=f"SLURM job array {sub.job_id}"):   # a second run on the same set
        extract(url, **OPTS)
    assert f"SLURM job array {sub.job_id} (2 tasks): queued or running" in describe(FeatureStore.open(url), NAME)
    go.touch()
    _wait(lambda: _slurm_array_ended(local_slurm["env"], sub.job_id), 400, f"array {sub.job_id} to end")
    fs = FeatureStore.open(url).features(NAME)
    logs = "".join(p.read_text() for p in jobs.glob("*.out"))
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}, logs
    assert np.array_equal(fs.data[:], reference)                          # bit for bit as on disk
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}    # each block committed once
    assert integrity.verify(fs).ok
    assert logs.count("vsekit array task: committed block") == 6
    _leaks_nothing(s3, [tmp_path])   # the job script, the task logs
    text = describe(FeatureStore.open(url), NAME)
    assert f"SLURM job array {sub.job_id} (2 tasks): ended" in text and "blocks: 6 done, 0 pending of 6" in text


@pytest.mark.slow
def test_slurm_array_tasks_killed_between_chunks_and_record_then_the_rerun_commit_every_block_once(
        local_slurm, s3, demo_dir, reference, tmp_path, monkeypatch):
    from vsekit.extract import extract
    from vsekit.storage import objcommit
    from vsekit.storage.objstore import Objects, holder_live, lease_key
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"queue": "vsekit"})
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "8")
    monkeypatch.setenv("VSEKIT_FAULT", "objstore:record@2")   # every task dies at its second record
    sub = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    _wait(lambda: _slurm_array_ended(local_slurm["env"], sub.job_id), 400, f"array {sub.job_id} to end")
    fs = FeatureStore.open(url).features(NAME)
    first = _records_per_block(s3)
    logs = "".join(p.read_text() for p in jobs.glob("*.out"))
    assert set(first.values()) == {1} and 1 <= len(first) <= 2, logs     # one committed block per task
    chunks = {int(k.split("/")[-2]) for k in s3.keys(f"x.zarr/features/{NAME}/data/c/")}
    assert chunks - set(first), chunks                                   # a block's chunks without a record
    assert fs.counts()["done"] == 4 * len(first)
    before = objcommit.records(fs)
    stamps = {i: s3.client.head_object(Bucket=s3.bucket, Key=f"x.zarr/features/{NAME}/data/c/{i}/0")["LastModified"]
              for i in first}
    objects = Objects(url)
    _wait(lambda: holder_live(objects.get_json(lease_key(NAME))[0]) is None, 60,
          "the dead array's lease to expire")                            # its job ended, no task renews it
    time.sleep(1.1)   # S3 times have whole seconds: a rewrite would show
    monkeypatch.delenv("VSEKIT_FAULT")
    again = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    assert again.job_id and again.pending_blocks == 6 - len(first)
    _wait(lambda: _slurm_array_ended(local_slurm["env"], again.job_id), 400, f"array {again.job_id} to end")
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}  # nothing committed twice
    after = objcommit.records(fs)
    assert all(after[i] == before[i] for i in first)                     # the first array's records kept
    for i in first:                                                      # and their chunks not rewritten
        assert s3.client.head_object(Bucket=s3.bucket, Key=f"x.zarr/features/{NAME}/data/c/{i}/0")["LastModified"] == stamps[i]


@pytest.mark.slow
def test_a_grid_engine_array_into_s3_equals_disk_and_leaks_no_storage_option(
        local_sge, s3, demo_dir, reference, tmp_path, monkeypatch):
    import sge_local

    from vsekit.extract import extract
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, local_sge["env"][key])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"memory_resource": "h_rss", "queue": sge_local.QUEUE})
    try:
        sub = extract(url, cluster="sge-array:2", device="cpu", **OPTS)
        assert sub.job_id and "Grid Engine job array" in sub.summary()
        _wait(lambda: sub.job_id not in sge_local.jobs(local_sge["env"]), 400, f"array {sub.job_id} to end")
    finally:
        sge_local.delete_all(local_sge["env"])
    fs = FeatureStore.open(url).features(NAME)
    logs = "".join(p.read_text() for p in jobs.rglob("*") if p.is_file() and p.suffix != ".sh")
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}, logs
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    _leaks_nothing(s3, [tmp_path])


@pytest.mark.slow
def test_a_task_killed_between_its_record_and_its_status_loses_nothing_and_commits_nothing_twice(
        s3, demo_dir, reference, fake_slurm, tmp_path, monkeypatch):
    """A task (a process, as the scheduler starts it) dies right after its first commit record, before
    that block's status; another task finds the block pending, takes its expired lease, restores the
    status from the record instead of extracting it again, and completes the set."""
    import subprocess

    from vsekit.extract.array import work
    from vsekit.extract import extract
    from vsekit.storage import objcommit
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "3")
    extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, VSEKIT_FAULT="write_block:status@1", SLURM_ARRAY_TASK_ID="0", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "vsekit.extract.array", url, NAME], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 137, proc.stderr
    [block] = _records_per_block(s3)                                   # its record, and no status
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts()["done"] == 0
    record = objcommit.read_record(fs, block)
    assert work(url, task=1, name=NAME) == 0
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert objcommit.read_record(fs, block) == record                  # kept: the block was not redone


# --- a researcher's faults, the tasks run as the scheduler starts them (stand-in sbatch / squeue) --
# Each task is ``python -m vsekit.extract.array URL NAME`` in a process of its own, with the array's
# SLURM variables; what reached the server is counted there (records per block, chunk objects and
# their bytes and times), not taken from what the tool reports.
def _task(url: str, k: int, log: Path, **extra: str):
    import subprocess

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID=str(k), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), **extra)
    return subprocess.Popen([sys.executable, "-m", "vsekit.extract.array", url, NAME], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def _task_leases(url: str, task: int) -> list[int]:
    """The blocks whose lease object names array task ``task`` (live or expired, not free)."""
    from vsekit.storage import job_arrays
    from vsekit.storage.store import FeatureStore

    return [s.key for s in job_arrays.place(FeatureStore.open(url), NAME).leases().states()
            if str(s.owner.get("task")) == str(task)]


def _chunk_objects(s3, blocks) -> dict[str, tuple[bytes, object]]:
    """Every data chunk object of ``blocks``: its bytes and its time of writing, as the server has them."""
    out = {}
    for i in blocks:
        for key in s3.keys(f"x.zarr/features/{NAME}/data/c/{i}/"):
            got = s3.client.get_object(Bucket=s3.bucket, Key=key)
            out[key] = (got["Body"].read(), got["LastModified"])
    return out


def _stop_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.slow
def test_on_s3_a_task_sigkilled_with_a_half_block_and_one_sigtermed_mid_block_leave_their_blocks_to_a_sibling(
        s3, demo_dir, reference, fake_slurm, tmp_path, monkeypatch):
    """Three tasks of one array. Task 0 commits a block, writes the chunks of its second and is killed
    with SIGKILL before that block's record (a node crash, OOM); task 1 gets SIGTERM (scancel, the time
    limit) while it holds its first block; task 2, started once both are gone, takes over task 0's
    expired lease, extracts both blocks and completes the set: one record per block, the bits of disk."""
    import signal

    from vsekit.extract import extract
    from vsekit.storage import integrity, job_arrays, objcommit
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "3")
    assert extract(url, cluster="slurm-array:3", device="cpu", **OPTS).pending_blocks == 6
    logs = [tmp_path / f"task{k}.log" for k in range(3)]
    hold = {k: tmp_path / f"never{k}" for k in range(2)}
    go = tmp_path / "go"
    procs = [_task(url, 0, logs[0], VSEKIT_PAUSE=f"objstore:record@2={hold[0]}", VSEKIT_PAUSE_MAX_S="600"),
             _task(url, 1, logs[1], VSEKIT_PAUSE=f"array-task-1:claimed={hold[1]}", VSEKIT_PAUSE_MAX_S="600"),
             _task(url, 2, logs[2], VSEKIT_PAUSE=f"array-task-2:start={go}", VSEKIT_PAUSE_MAX_S="600")]
    try:
        _wait(lambda: Path(f"{hold[0]}.reached").exists(), 120, "task 0 to write its second block's chunks")
        [half] = _task_leases(url, 0)                        # the block task 0 holds, chunks written
        assert half not in _records_per_block(s3)
        assert s3.keys(f"x.zarr/features/{NAME}/data/c/{half}/")   # its chunks are on the server
        [first] = _records_per_block(s3)                     # task 0's committed block
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(30) == -signal.SIGKILL
        _wait(lambda: Path(f"{hold[1]}.reached").exists(), 120, "task 1 to hold a block")
        [termed] = _task_leases(url, 1)
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(60) == 143
        leases = job_arrays.place(FeatureStore.open(url), NAME).leases()
        assert leases.state(termed).free                      # released at once, not left to expire
        assert termed not in _records_per_block(s3)
        assert half in _task_leases(url, 0)                   # the killed task's lease: left to expire
        assert FeatureStore.open(url).features(NAME).counts()["done"] == 4
        go.touch()
        assert procs[2].wait(240) == 0, logs[2].read_text()
    finally:
        _stop_all(procs)
    out = [p.read_text() for p in logs]
    assert "terminated (SIGTERM) after committing 0 block(s); the block in progress stays pending" in out[1]
    assert f"block {half}: took over the expired lease of job 4242 task 0" in out[2], out[2]
    assert f"committed block {half} " in out[2] and f"committed block {termed} " in out[2]
    assert out[2].count("committed block") == 5               # every block but task 0's first
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)              # bit for bit as on disk
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}   # each block committed once
    records = objcommit.records(fs)
    assert set(records) == set(range(6)) and first in records
    assert integrity.verify(fs).ok
    assert not _task_leases(url, 0) and not _task_leases(url, 2)


@pytest.mark.slow
def test_on_s3_requeued_tasks_that_had_written_chunks_and_a_record_write_nothing_twice(
        s3, demo_dir, reference, fake_slurm, tmp_path, monkeypatch):
    """Task 0 commits a block and is killed (SIGKILL) with its second block's chunks written and no
    record; task 1 commits a block and dies between its second block's record and status. Both are
    requeued (the same job and task ids run again): every block ends with one record and the bits of
    disk, and the blocks that had a record keep it and keep every chunk object byte for byte, unwritten."""
    import signal

    from vsekit.extract import extract
    from vsekit.storage import integrity, objcommit
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "3")
    assert extract(url, cluster="slurm-array:2", device="cpu", **OPTS).pending_blocks == 6
    hold = tmp_path / "never"
    procs = [_task(url, 0, tmp_path / "t0.log", VSEKIT_PAUSE=f"objstore:record@2={hold}", VSEKIT_PAUSE_MAX_S="600"),
             _task(url, 1, tmp_path / "t1.log", VSEKIT_FAULT="write_block:status@2")]
    try:
        assert procs[1].wait(240) == 137, (tmp_path / "t1.log").read_text()
        _wait(lambda: Path(f"{hold}.reached").exists(), 120, "task 0 to write its second block's chunks")
        [half] = _task_leases(url, 0)
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(30) == -signal.SIGKILL
    finally:
        _stop_all(procs)
    fs = FeatureStore.open(url).features(NAME)
    recorded = sorted(_records_per_block(s3))
    assert len(recorded) == 3 and half not in recorded        # task 0's first, task 1's two
    assert s3.keys(f"x.zarr/features/{NAME}/data/c/{half}/")   # a half block: chunks, no record
    assert fs.counts()["done"] == 8                            # task 1's second block: record, no status
    before_records = objcommit.records(fs)
    before_chunks = _chunk_objects(s3, recorded)
    assert len(before_chunks) == len(recorded)
    time.sleep(1.1)   # S3 times have whole seconds: a rewrite would show

    requeued = [_task(url, k, tmp_path / f"t{k}.again.log") for k in range(2)]
    try:
        codes = [p.wait(240) for p in requeued]
    finally:
        _stop_all(requeued)
    out = "".join((tmp_path / f"t{k}.again.log").read_text() for k in range(2))
    assert codes == [0, 0], out
    assert out.count("status restored from its commit record") == 1, out
    assert out.count("committed block") == 3, out             # the half block and the two never started
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}   # nothing committed twice
    after = objcommit.records(fs)
    assert {i: after[i] for i in recorded} == {i: before_records[i] for i in recorded}
    assert _chunk_objects(s3, recorded) == before_chunks      # same bytes, same time: not rewritten
    assert integrity.verify(fs).ok


@pytest.mark.slow
def test_on_s3_an_array_whose_tasks_all_died_shows_in_info_holds_the_set_then_a_rerun_submits_the_rest(
        s3, demo_dir, reference, fake_slurm, tmp_path, monkeypatch):
    """While the array's job is queued or running, `vsekit split` (the store's lease) and another
    extract are refused; every task dies with blocks left; `vsekit info` shows the array ended and the
    blocks done and pending; once the set's lease expired, the same command submits a new array for
    the pending blocks only, which completes the set with the first array's records kept."""
    from click.testing import CliRunner

    from vsekit.cli import main
    from vsekit.extract import extract
    from vsekit.storage import objcommit
    from vsekit.storage.objstore import LeaseHeld, Objects, holder_live, lease_key
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "3")
    split_before = FeatureStore.open(url).root["images/split"][:]
    sub = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    assert sub.job_id == "4242" and sub.pending_blocks == 6
    _squeue(fake_slurm, running=True)
    runner = CliRunner()
    r = runner.invoke(main, ["split", "--store", url, "--val", "4", "--test", "4"])
    assert r.exit_code == 1 and r.output.startswith("Error: "), r.output
    assert f"is being written by SLURM job array 4242" in r.output and len(r.output.strip().splitlines()) == 1
    assert np.array_equal(FeatureStore.open(url).root["images/split"][:], split_before)   # nothing changed
    assert not s3.keys("x.zarr/.vsekit/leases/.store")                                    # no store lease left

    procs = [_task(url, k, tmp_path / f"t{k}.log", VSEKIT_FAULT="objstore:record@2") for k in range(2)]
    try:
        assert [p.wait(240) for p in procs] == [137, 137]    # each died with its second block's chunks
    finally:
        _stop_all(procs)
    first = _records_per_block(s3)
    assert set(first.values()) == {1} and len(first) == 2
    r = runner.invoke(main, ["split", "--store", url, "--val", "4", "--test", "4"])   # still listed by squeue
    assert r.exit_code == 1 and "SLURM job array 4242" in r.output, r.output
    with pytest.raises(LeaseHeld, match="SLURM job array 4242 .*scancel 4242"):
        extract(url, **OPTS)
    _squeue(fake_slurm, running=False)                       # the job has left the queue
    r = runner.invoke(main, ["info", url, NAME])
    assert r.exit_code == 0, r.output
    assert "SLURM job array 4242 (2 tasks): ended" in r.output, r.output
    assert "blocks: 2 done, 4 pending of 6" in r.output and "done 8 / failed 0 / pending 16" in r.output, r.output
    assert "the array has ended with blocks left: rerun the same extract command" in r.output
    live, expired = map(int, re.search(r"leases: (\d+) live, (\d+) expired", r.output).groups())
    assert live + expired == 2                               # the half blocks of the dead tasks
    for k in range(2):
        [half] = _task_leases(url, k)
        assert half not in first and f"block {half}: job 4242 task {k} " in r.output, r.output
    objects = Objects(url)
    _wait(lambda: holder_live(objects.get_json(lease_key(NAME))[0]) is None, 30, "the array's lease to expire")
    before = objcommit.records(FeatureStore.open(url).features(NAME))
    (fake_slurm / "bin" / "sbatch").write_text(f'#!/bin/bash\ncp "${{@: -1}}" {fake_slurm}/again.sh\necho 4343\n')
    again = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    assert (again.job_id, again.pending_blocks, again.done) == ("4343", 4, 8)   # the pending blocks only
    assert "#SBATCH --array=0-1" in (fake_slurm / "again.sh").read_text()
    _squeue(fake_slurm, running=True)
    r = runner.invoke(main, ["split", "--store", url, "--val", "4", "--test", "4"])
    assert r.exit_code == 1 and "SLURM job array 4343" in r.output, r.output
    r = runner.invoke(main, ["info", url, NAME])
    assert "SLURM job array 4343 (2 tasks): queued or running" in r.output, r.output
    task = _task(url, 0, tmp_path / "again.log")
    try:
        assert task.wait(240) == 0, (tmp_path / "again.log").read_text()
    finally:
        _stop_all([task])
    assert (tmp_path / "again.log").read_text().count("committed block") == 4
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    after = objcommit.records(fs)
    assert all(after[i] == before[i] for i in first)


@pytest.mark.slow
def test_on_slurm_into_s3_a_cancelled_and_a_timed_out_task_release_their_blocks_and_the_rerun_completes(
        local_slurm, s3, demo_dir, reference, tmp_path, monkeypatch):
    """On the local SLURM: task 0 commits a block and holds its next one when it is cancelled
    (``scancel``); task 1 holds its first block past its time limit (one minute, brought forward by
    ``scontrol update EndTime``: slurm_local.time_out). SLURM sends each
    SIGTERM: each releases its block's lease (no record, no chunk of the block) and exits 143. The same
    command, once the array's lease expired, submits the blocks still pending and completes the set."""
    import slurm_local
    import subprocess

    from vsekit.extract import extract
    from vsekit.storage import job_arrays, objcommit
    from vsekit.storage.objstore import Objects, holder_live, lease_key
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"queue": "vsekit", "walltime": "00:01:00"})
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "4")
    hold = {k: tmp_path / f"never{k}" for k in range(2)}
    monkeypatch.setenv("VSEKIT_PAUSE", f"array-task-0:claimed@2={hold[0]},array-task-1:claimed={hold[1]}")
    monkeypatch.setenv("VSEKIT_PAUSE_MAX_S", "600")
    sub = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    job = sub.job_id
    assert job and sub.pending_blocks == 6
    leases = job_arrays.place(FeatureStore.open(url), NAME).leases()
    _wait(lambda: Path(f"{hold[0]}.reached").exists() and Path(f"{hold[1]}.reached").exists(), 240,
          "task 0 to commit a block and hold another, task 1 to hold its first")
    [first] = _records_per_block(s3)
    held = {k: _task_leases(url, k) for k in range(2)}
    assert len(held[0]) == 1 and len(held[1]) == 1, held
    subprocess.run([slurm_local.which("scancel"), f"{job}_0"], env=local_slurm["env"], check=True)
    slurm_local.time_out(local_slurm["env"], f"{job}_1")   # its one-minute limit, brought forward
    _wait(lambda: _slurm_array_ended(local_slurm["env"], job), 240, f"array {job} to end (task 1 at its time limit)")
    out = {k: (jobs / f"vsekit-{NAME}-{job}_{k}.out").read_text() for k in range(2)}
    assert "CANCELLED AT" in out[0] and "TIME LIMIT" not in out[0], out[0]
    assert "DUE TO TIME LIMIT" in out[1], out[1]
    for k in range(2):
        assert "terminated (SIGTERM)" in out[k] and "the block in progress stays pending" in out[k], out[k]
        assert leases.state(held[k][0]).free                     # released, not left to expire
        assert held[k][0] not in _records_per_block(s3)
        assert not s3.keys(f"x.zarr/features/{NAME}/data/c/{held[k][0]}/")   # no chunk of a block in progress
    assert _records_per_block(s3) == {first: 1}
    assert FeatureStore.open(url).features(NAME).counts() == {"pending": 20, "done": 4, "failed": 0}
    before = objcommit.records(FeatureStore.open(url).features(NAME))
    chunks = _chunk_objects(s3, [first])
    objects = Objects(url)
    _wait(lambda: holder_live(objects.get_json(lease_key(NAME))[0]) is None, 60, "the array's lease to expire")

    monkeypatch.delenv("VSEKIT_PAUSE")
    config = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps(dict(config, walltime="00:20:00")))
    again = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    assert again.job_id and again.pending_blocks == 5
    _wait(lambda: _slurm_array_ended(local_slurm["env"], again.job_id), 400, f"array {again.job_id} to end")
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert objcommit.records(fs)[first] == before[first] and _chunk_objects(s3, [first]) == chunks


@pytest.mark.slow
def test_on_s3_a_sigterm_while_a_task_commits_lets_that_commit_finish_then_stops_it(
        s3, demo_dir, reference, fake_slurm, tmp_path, monkeypatch):
    """SIGTERM reaches a task after its block's chunks are on the server and before the block's record:
    the commit finishes (record, then status), the lease is released, the task exits 143; no block is
    left half written, and the rerun's task extracts the rest, with each block committed once."""
    import signal

    from vsekit.extract import extract
    from vsekit.storage import job_arrays, objcommit
    from vsekit.storage.objstore import Objects, holder_live, lease_key
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "3")
    extract(url, cluster="slurm-array:1", device="cpu", **OPTS)
    go = tmp_path / "go"
    proc = _task(url, 0, tmp_path / "t0.log", VSEKIT_PAUSE=f"objstore:record@2={go}", VSEKIT_PAUSE_MAX_S="600")
    try:
        _wait(lambda: Path(f"{go}.reached").exists(), 120, "the task to write its second block's chunks")
        [block] = _task_leases(url, 0)
        assert block not in _records_per_block(s3) and s3.keys(f"x.zarr/features/{NAME}/data/c/{block}/")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        go.touch()
        assert proc.wait(60) == 143
    finally:
        _stop_all([proc])
    out = (tmp_path / "t0.log").read_text()
    assert f"committed block {block} " in out and "terminated (SIGTERM) after committing 2 block(s)" in out, out
    fs = FeatureStore.open(url).features(NAME)
    records = _records_per_block(s3)
    assert len(records) == 2 and records[block] == 1 and set(records.values()) == {1}
    assert fs.block_done(fs.blocks()[block]) and fs.counts()["done"] == 8    # record and status: whole
    assert job_arrays.place(FeatureStore.open(url), NAME).leases().state(block).free
    before = objcommit.records(fs)
    objects = Objects(url)
    _wait(lambda: holder_live(objects.get_json(lease_key(NAME))[0]) is None, 30, "the array's lease to expire")
    sub = extract(url, cluster="slurm-array:1", device="cpu", **OPTS)       # the same command
    assert sub.pending_blocks == 4
    again = _task(url, 0, tmp_path / "again.log")
    try:
        assert again.wait(240) == 0, (tmp_path / "again.log").read_text()
    finally:
        _stop_all([again])
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert all(objcommit.records(fs)[i] == before[i] for i in before)


def _sge_task_listed(env, job: str, task: str) -> bool:
    """Whether ``qstat`` lists task ``task`` of array job ``job`` (its last column, ja-task-ID)."""
    import subprocess

    import sge_local

    out = subprocess.run([sge_local.which("qstat"), "-u", "*"], env=env, capture_output=True, text=True).stdout
    return any(ln.split()[:1] == [job] and ln.split()[-1] == task for ln in out.splitlines())


@pytest.mark.slow
def test_on_grid_engine_into_s3_a_deleted_task_leaves_its_block_to_its_sibling(
        local_sge, s3, demo_dir, reference, tmp_path, monkeypatch):
    """``sge-array:2`` on the local Grid Engine: task 2 commits a block and holds its next one when it
    is deleted (``qdel -t 2``: killed outright, no SIGTERM); task 1, held at its start until then,
    takes over the expired lease and completes the set: one record per block, the bits of disk."""
    import subprocess

    import sge_local

    from vsekit.extract import extract
    from vsekit.storage import integrity
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, local_sge["env"][key])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"memory_resource": "h_rss", "queue": sge_local.QUEUE})
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "4")
    hold, go = tmp_path / "never", tmp_path / "go"
    monkeypatch.setenv("VSEKIT_PAUSE", f"array-task-2:claimed@2={hold},array-task-1:start={go}")
    monkeypatch.setenv("VSEKIT_PAUSE_MAX_S", "600")
    try:
        sub = extract(url, cluster="sge-array:2", device="cpu", **OPTS)
        job = sub.job_id
        _wait(lambda: Path(f"{hold}.reached").exists(), 240, "task 2 to commit a block and hold its next")
        [first] = _records_per_block(s3)
        [held] = _task_leases(url, 2)                      # Grid Engine numbers the tasks from 1
        assert held != first and held not in _records_per_block(s3)
        assert _sge_task_listed(local_sge["env"], job, "2")
        subprocess.run([sge_local.which("qdel"), job, "-t", "2"], env=local_sge["env"], check=True, capture_output=True)
        _wait(lambda: not _sge_task_listed(local_sge["env"], job, "2"), 60, "task 2 to leave the queue")
        go.touch()
        _wait(lambda: job not in sge_local.jobs(local_sge["env"]), 300, f"array {job} to end")
    finally:
        sge_local.delete_all(local_sge["env"])
    logs = "".join(p.read_text() for p in jobs.rglob("*") if p.is_file() and p.suffix != ".sh")
    assert f"block {held}: took over the expired lease of job {job} task 2" in logs, logs
    assert logs.count("committed block") == 6, logs       # task 2's one and task 1's five: each once
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert integrity.verify(fs).ok


@pytest.mark.slow
def test_on_s3_a_task_suspended_past_its_lease_writes_nothing_when_it_resumes(
        s3, demo_dir, reference, fake_slurm, tmp_path, monkeypatch):
    """Preemption by suspension (SLURM's ``PreemptMode=SUSPEND``: SIGSTOP, later SIGCONT): task 0 is
    stopped while it holds a block; its sibling takes the expired lease over and completes the set.
    Resumed, task 0 extracts the block, finds its lease lost and writes nothing: no record, and every
    chunk object keeps the bytes and the time of writing its sibling gave it."""
    import signal

    from vsekit.extract import extract
    from vsekit.storage import objcommit
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "3")
    extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    hold, go = tmp_path / "hold", tmp_path / "go"
    procs = [_task(url, 0, tmp_path / "t0.log", VSEKIT_PAUSE=f"array-task-0:claimed={hold}", VSEKIT_PAUSE_MAX_S="600"),
             _task(url, 1, tmp_path / "t1.log", VSEKIT_PAUSE=f"array-task-1:start={go}", VSEKIT_PAUSE_MAX_S="600")]
    try:
        _wait(lambda: Path(f"{hold}.reached").exists(), 120, "task 0 to hold a block")
        [held] = _task_leases(url, 0)
        procs[0].send_signal(signal.SIGSTOP)
        go.touch()
        assert procs[1].wait(240) == 0, (tmp_path / "t1.log").read_text()
        fs = FeatureStore.open(url).features(NAME)
        assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
        records = objcommit.records(fs)
        chunks = _chunk_objects(s3, range(6))
        assert len(records) == 6 and len(chunks) == 6
        time.sleep(1.1)   # S3 times have whole seconds: a rewrite would show
        hold.touch()
        procs[0].send_signal(signal.SIGCONT)
        assert procs[0].wait(120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        _stop_all(procs)
    out = [(tmp_path / f"t{k}.log").read_text() for k in range(2)]
    assert f"block {held}: took over the expired lease of job 4242 task 0" in out[1], out[1]
    assert f"block {held} not committed: its lease was lost (expired and taken over)" in out[0], out[0]
    assert "committed block" not in out[0]
    fs = FeatureStore.open(url).features(NAME)
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert objcommit.records(fs) == records and _chunk_objects(s3, range(6)) == chunks   # nothing rewritten
