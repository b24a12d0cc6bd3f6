"""`extract --cluster slurm-array:N` / `sge-array:N` into an ``s3://`` store (issue 35), against the local
S3 server (the ``s3`` fixture).

* default set: the block leases as objects (claim, renewal, takeover only after expiry, a holder
  that lost its lease can neither renew nor release the new holder's), on a logical clock; the set's
  lease handed to the array with a stand-in ``sbatch`` / ``squeue`` (the tasks run here, in-process);
* slow, on the throw-away one-node SLURM and Grid Engine (tests/slurm_local.py, sge_local.py): the
  arrays' results equal the in-process run on disk bit for bit with one commit record per block, the
  ``--storage-option`` secret is in no job script, log, spec or object, another extract is refused
  while the array holds the set, and tasks killed between their chunks and their records are made
  good by the rerun with nothing committed twice.
"""

from __future__ import annotations

import json
import os
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


def _wait(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    import slurm_local

    why = slurm_local.unavailable()
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("slurm")
    with slurm_local.local_slurm(folder) as env:
        yield env


def _slurm_array_ended(env, job: str) -> bool:
    import slurm_local

    return not [j for j in slurm_local.jobs(env) if j.split("_")[0] == job]


@pytest.mark.slow
def test_a_slurm_array_into_s3_equals_disk_holds_the_set_and_leaks_no_storage_option(
        slurm, s3, demo_dir, reference, tmp_path, monkeypatch):
    from vsekit.extract import extract
    from vsekit.storage import integrity
    from vsekit.storage.info import describe
    from vsekit.storage.objstore import LeaseHeld
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
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
    _wait(lambda: _slurm_array_ended(slurm, sub.job_id), 400, f"array {sub.job_id} to end")
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
        slurm, s3, demo_dir, reference, tmp_path, monkeypatch):
    from vsekit.extract import extract
    from vsekit.storage import objcommit
    from vsekit.storage.objstore import Objects, holder_live, lease_key
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"queue": "vsekit"})
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "8")
    monkeypatch.setenv("VSEKIT_FAULT", "objstore:record@2")   # every task dies at its second record
    sub = extract(url, cluster="slurm-array:2", device="cpu", **OPTS)
    _wait(lambda: _slurm_array_ended(slurm, sub.job_id), 400, f"array {sub.job_id} to end")
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
    _wait(lambda: _slurm_array_ended(slurm, again.job_id), 400, f"array {again.job_id} to end")
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}  # nothing committed twice
    after = objcommit.records(fs)
    assert all(after[i] == before[i] for i in first)                     # the first array's records kept
    for i in first:                                                      # and their chunks not rewritten
        assert s3.client.head_object(Bucket=s3.bucket, Key=f"x.zarr/features/{NAME}/data/c/{i}/0")["LastModified"] == stamps[i]


@pytest.fixture(scope="module")
def sge():
    import sge_local

    why = sge_local.unavailable()
    if why:
        pytest.skip(why)
    with sge_local.local_sge() as env:
        yield env


@pytest.mark.slow
def test_a_grid_engine_array_into_s3_equals_disk_and_leaks_no_storage_option(
        sge, s3, demo_dir, reference, tmp_path, monkeypatch):
    import sge_local

    from vsekit.extract import extract
    from vsekit.storage.store import FeatureStore

    url = _ingest(s3, demo_dir)
    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, sge[key])
    jobs = _on_cluster(s3, monkeypatch, tmp_path, {"memory_resource": "h_rss", "queue": sge_local.QUEUE})
    try:
        sub = extract(url, cluster="sge-array:2", device="cpu", **OPTS)
        assert sub.job_id and "Grid Engine job array" in sub.summary()
        _wait(lambda: sub.job_id not in sge_local.jobs(sge), 400, f"array {sub.job_id} to end")
    finally:
        sge_local.delete_all(sge)
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
