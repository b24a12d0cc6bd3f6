"""`--cluster pbs:N` end to end through dask-jobqueue's PBSCluster, on a stand-in PBS (tests/pbs_local.py:
`qsub` starts the job script at once, in its own session, with a node's minimal environment).

No PBS server can run here, so this tests vsekit's side for real: its PBS job settings, the job script
dask-jobqueue writes from them, submitting and cancelling exactly the run's jobs, and that the
workers do the work: extraction on a disk store and into an ``s3://`` store equals the in-process run
on disk bit for bit. On object storage the jobs have no AWS variable at all: the endpoint and the
credentials reach them only with their tasks (`--storage-option`), and the secret is in no job
script, job log or object. `standardize --cluster pbs:2` there equals the in-process stage on disk.
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
import pbs_local  # noqa: E402  (tests/pbs_local.py)

pytestmark = pytest.mark.slow

ARGS = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--seed", "3", "--crops", "1",
        "--input-size", "64", "--resize", "72", "--batch-size", "2", "--block-rows", "4", "--no-progress",
        "--device", "cpu"]
NAME = "test_resnet_fne"
OPTION_SECRET = "vsekit-pbs-option-secret-in-no-file"


@pytest.fixture()
def pbs(tmp_path):
    folder = tmp_path / "pbs"
    env = pbs_local.install(folder)
    yield {"env": env, "dir": folder}
    pbs_local.end_all(folder)


def _vsekit(args, env, timeout=500) -> str:
    proc = subprocess.run([sys.executable, "-c", "from vsekit.cli import main; main()", *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out
    return out


def _env(pbs, **more) -> dict:
    config = {"interface": "lo", "cores": 1, "memory": "2GB", "walltime": "00:20:00", "python": sys.executable}
    return {**os.environ, **pbs["env"], "OMP_NUM_THREADS": "1", "VSEKIT_CLUSTER_CONFIG": json.dumps(config), **more}


def _jobs_ran(pbs) -> list[Path]:
    """The job scripts the stand-in was given: PBS scripts, each ended with the run."""
    scripts = sorted((pbs["dir"] / "jobs").glob("*.sh"))
    assert len(scripts) >= 2, scripts                      # pbs:2: two jobs (more if one was replaced)
    for s in scripts:
        text = s.read_text()
        assert "#PBS -l walltime=00:20:00" in text and "distributed.cli.dask_worker" in text, text
    assert pbs_local.live_jobs(pbs["dir"]) == []          # qdel ended every job of the run
    return scripts


def test_extract_on_pbs_jobs_into_a_disk_store_equals_in_process(pbs, demo_dir, tmp_path):
    from test_objstore_slow import OPTS

    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore

    import torch

    torch.set_num_threads(1)
    ref, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "ref.zarr")
    want = ref.features(extract(ref, workers=0, **OPTS).name).data[:]
    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    _vsekit(["extract", "--store", str(tmp_path / "d.zarr"), *ARGS, "--cluster", "pbs:2"], _env(pbs))
    fs = FeatureStore.open(tmp_path / "d.zarr").features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], want)
    _jobs_ran(pbs)


def test_extract_and_standardize_on_pbs_jobs_into_s3_equal_disk_and_leak_no_secret(pbs, s3, demo_dir, tmp_path):
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
    # no AWS variable in the driver's environment either: everything comes from --storage-option
    env = {k: v for k, v in _env(pbs).items() if not k.startswith("AWS_")}
    opts = []
    for pair in (f"endpoint={s3.endpoint}", "access_key_id=vsekit-test-key",
                 f"secret_access_key={OPTION_SECRET}", "region=us-east-1"):
        opts += ["--storage-option", pair]
    out = _vsekit(["extract", "--store", url, *opts, *ARGS, "--cluster", "pbs:2"], env)
    out += _vsekit(["standardize", "--store", url, *opts, "--features", NAME, "--cluster", "pbs:2"], env)
    store = FeatureStore.open(url)
    fs = store.features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], ref.features(NAME).data[:])
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    for arr in ("data", "mean", "std", "status"):
        assert np.array_equal(store.features(NAME + ".z").group[arr][:], ref.features(NAME + ".z").group[arr][:])
    scripts = _jobs_ran(pbs)
    assert len(scripts) >= 4                                   # two runs, two jobs each
    written = [p for p in (pbs["dir"] / "jobs").iterdir() if p.is_file()]
    for p in written:                                          # job scripts, job logs, pid files
        assert OPTION_SECRET.encode() not in p.read_bytes(), p
        assert b"AWS_" not in p.read_bytes() or p.suffix != ".sh", p
    assert OPTION_SECRET not in out
    for key in s3.keys():
        assert OPTION_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key
