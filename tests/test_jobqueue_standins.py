"""`--cluster pbs:N`, `lsf:N` and `htcondor:N` end to end through dask-jobqueue's PBSCluster,
LSFCluster and HTCondorCluster, on stand-ins (tests/pbs_local.py, tests/lsf_local.py,
tests/htcondor_local.py; what they share: tests/batch_local.py).

No PBS, LSF or HTCondor server can run here, so this tests vsekit's side for real: its settings for
each scheduler, the job script (PBS: ``#PBS`` lines, started by ``qsub`` at once in its own session
with a node's minimal environment; LSF: ``#BSUB`` lines, fed to ``bsub`` on its standard input, the
walltime and memory in bsub's words, checked as bsub checks them) or submit description (HTCondor:
``Executable`` and ``Arguments``, run with HTCondor's bare job environment) dask-jobqueue writes
from them, the job id read back from the scheduler's answer, the jobs' logs where the directives put
them, and cancelling exactly the run's jobs; and that the workers do the work: extraction on a disk
store and into an ``s3://`` store equals the in-process run on disk bit for bit, one commit record
per block, and ``standardize`` there gives the in-process set. On object storage the endpoint and the credentials reach the jobs only with their tasks
(``--storage-option``; no ``AWS_*`` variable anywhere), and the secret is in no job script, job log
or object. Not tested: the schedulers' own scheduling (queues, limits, placement).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dask_jobqueue")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import batch_local  # noqa: E402  (tests/batch_local.py)
import htcondor_local  # noqa: E402
import lsf_local  # noqa: E402
import pbs_local  # noqa: E402

pytestmark = pytest.mark.slow

ARGS = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--seed", "3", "--crops", "1",
        "--input-size", "64", "--resize", "72", "--batch-size", "2", "--block-rows", "4", "--no-progress",
        "--device", "cpu"]
NAME = "test_resnet_fne"
OPTION_SECRET = "vsekit-jobqueue-option-secret-in-no-file"
STANDINS = {"pbs": pbs_local, "lsf": lsf_local, "htcondor": htcondor_local}
# the settings of each: PBS's walltime HH:MM:SS; LSF's in bsub -W's [HH:]MM; HTCondor jobs take none
SETTINGS = {"pbs": {"walltime": "00:20:00"}, "lsf": {"walltime": "00:20"}, "htcondor": {}}


@pytest.fixture(params=["pbs", "lsf", "htcondor"])
def sched(request, tmp_path):
    kind = request.param
    folder = tmp_path / kind
    env = STANDINS[kind].install(folder)
    yield {"kind": kind, "env": env, "dir": folder}
    batch_local.end_all(folder)


def _vsekit(args, env, timeout=300) -> str:
    proc = subprocess.run([sys.executable, "-c", "from vsekit.cli import main; main()", *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out
    return out


def _env(sched, **more) -> dict:
    config = {"interface": "lo", "cores": 1, "memory": "2GB", "python": sys.executable,
              "log_directory": str(sched["dir"] / "logs"), **SETTINGS[sched["kind"]]}
    return {**os.environ, **sched["env"], "OMP_NUM_THREADS": "1", "VSEKIT_CLUSTER_CONFIG": json.dumps(config), **more}


def _jobs_ran(sched) -> list[Path]:
    """What the stand-in was given (PBS, LSF: the job scripts; HTCondor: the submit descriptions),
    each a job of the run, its logs where its directives put them (LSF, HTCondor), each ended with the run."""
    jobs, logs = sched["dir"] / "jobs", sched["dir"] / "logs"
    if sched["kind"] == "pbs":
        given = sorted(jobs.glob("*.sh"))
        for s in given:
            text = s.read_text()
            assert "#PBS -l walltime=00:20:00" in text and "distributed.cli.dask_worker" in text, text
    elif sched["kind"] == "lsf":
        given = sorted(jobs.glob("*.sh"))
        for s in given:
            text = s.read_text()
            assert "#BSUB -W 00:20" in text and "#BSUB -M 2000000" in text and "#BSUB -n 1" in text, text
            assert "distributed.cli.dask_worker" in text and "--lifetime 1080s" in text, text
            job = s.stem   # LSB_JOBID, parsed by dask-jobqueue from "Job <ID> is submitted to queue <normal>."
            err = list(logs.glob(f"*-{job}.err"))   # -e .../NAME-%J.err, %J: the job id
            assert len(err) == 1 and list(logs.glob(f"*-{job}.out")), sorted(logs.iterdir())
            assert "Start worker" in err[0].read_text()
            assert (jobs / f"{job}.cancelled").exists()      # bkill JOB by the run, with the id bsub printed
    else:
        given = sorted(jobs.glob("*.sub"))
        for s in given:
            text = s.read_text()
            assert "Executable = /bin/sh" in text and "distributed.cli.dask_worker" in text, text
            assert "MY.DaskWorkerCores = 1" in text and "MY.DaskWorkerMemory = 2000000000" in text, text
            cluster = s.stem   # dask-jobqueue's job id: "CLUSTER.0", from "1 job(s) submitted to cluster CLUSTER."
            assert "Start worker" in (logs / f"worker-{cluster}.0.err").read_text()
            events = (logs / f"worker-{cluster}.log").read_text()
            assert "Job executing" in events and "Job was aborted" in events, events   # condor_rm'd
            assert (jobs / f"{cluster}.0.cancelled").exists()   # by the id "CLUSTER.0" dask-jobqueue made
    assert len(given) >= 2, given                          # two jobs (more if one was replaced)
    assert batch_local.live_jobs(sched["dir"]) == []       # the cancel command ended every job of the run
    return given


def test_extract_on_standin_jobs_into_a_disk_store_equals_in_process(sched, demo_dir, tmp_path):
    from test_objstore_slow import OPTS

    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore

    import torch

    torch.set_num_threads(1)
    ref, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "ref.zarr")
    want = ref.features(extract(ref, workers=0, **OPTS).name).data[:]
    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    _vsekit(["extract", "--store", str(tmp_path / "d.zarr"), *ARGS, "--cluster", f"{sched['kind']}:2"], _env(sched))
    fs = FeatureStore.open(tmp_path / "d.zarr").features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], want)
    _jobs_ran(sched)


def test_extract_and_standardize_on_standin_jobs_into_s3_equal_disk_and_leak_no_secret(sched, s3, demo_dir,
                                                                                                 tmp_path):
    from test_objstore_slow import OPTS, _records_per_block

    from vsekit.extract import extract
    from vsekit.fne import standardize
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore

    import torch

    torch.set_num_threads(1)
    ref, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "ref.zarr")
    extract(ref, workers=0, **OPTS)
    standardize(ref, NAME)
    url = s3.url()
    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, url)
    # no AWS variable in the driver's environment either (LSF copies it into the jobs): everything
    # comes from --storage-option
    env = {k: v for k, v in _env(sched).items() if not k.startswith("AWS_")}
    opts = []
    for pair in (f"endpoint={s3.endpoint}", "access_key_id=vsekit-test-key",
                 f"secret_access_key={OPTION_SECRET}", "region=us-east-1"):
        opts += ["--storage-option", pair]
    cluster = f"{sched['kind']}:2"
    out = _vsekit(["extract", "--store", url, *opts, *ARGS, "--cluster", cluster], env)
    out += _vsekit(["standardize", "--store", url, *opts, "--features", NAME, "--cluster", cluster], env)
    store = FeatureStore.open(url)
    fs = store.features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], ref.features(NAME).data[:])
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    for arr in ("data", "mean", "std", "status"):
        assert np.array_equal(store.features(NAME + ".z").group[arr][:], ref.features(NAME + ".z").group[arr][:])
    assert len(_jobs_ran(sched)) >= 4                          # two runs, two jobs each
    written = [p for p in sched["dir"].rglob("*") if p.is_file()]   # job scripts, job logs, events, pids
    # the jobs' logs: where the directives put them (LSF, HTCondor), beside the job (the PBS stand-in)
    assert any(p.parent.name == "logs" or p.suffix == ".err" for p in written)
    for p in written:
        assert OPTION_SECRET.encode() not in p.read_bytes(), p
    assert OPTION_SECRET not in out
    for key in s3.keys():
        assert OPTION_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key


@pytest.mark.parametrize("sched", ["lsf", "htcondor"], indirect=True)
def test_no_job_starting_a_worker_in_time_is_one_error_with_the_schedulers_state(sched, demo_dir, tmp_path):
    """Jobs that run but start no worker within start_timeout (here: a prologue that sleeps): one
    Error line with each job's state as the status command (bjobs -w, condor_q -nobatch) gives it,
    and both jobs cancelled; nothing is written to the set."""
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore

    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    env = _env(sched)
    config = {**json.loads(env["VSEKIT_CLUSTER_CONFIG"]), "start_timeout": 4, "prologue": ["/bin/sleep 120"]}
    env["VSEKIT_CLUSTER_CONFIG"] = json.dumps(config)
    kind = sched["kind"]
    proc = subprocess.run([sys.executable, "-c", "from vsekit.cli import main; main()", "extract", "--store",
                           str(tmp_path / "d.zarr"), *ARGS, "--cluster", f"{kind}:2"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = proc.stdout.decode()
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1, out
    label, status = {"lsf": ("LSF", "bjobs"), "htcondor": ("HTCondor", "condor_q")}[kind]
    ids = ["1", "2"] if kind == "lsf" else ["1.0", "2.0"]            # the stand-in numbers jobs 1, 2, ...
    state = "RUN" if kind == "lsf" else "R"
    assert f"no {label} job started within 4 s (start_timeout); {status}: " in errors[0], errors
    for job in ids:
        assert f"job {job} {state} ({status})" in errors[0], errors
    assert batch_local.live_jobs(sched["dir"]) == []
    assert all((sched["dir"] / "jobs" / f"{j}.cancelled").exists() for j in ids)
    assert NAME not in FeatureStore.open(tmp_path / "d.zarr").feature_names()
