"""`extract --cluster slurm:N` (and `sge:N`) into an ``s3://`` store (issue 35), on a throw-away
one-node SLURM (Grid Engine) and the local S3 server: the jobs get the storage options with their tasks (in memory, over dask's
connection), so nothing secret is written into a job script, a job log or SLURM's own files, and the
extraction equals the one on disk bit for bit. Job arrays on object storage: tests/test_objstore_array.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")
pytest.importorskip("dask_jobqueue")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurm_local  # noqa: E402  (tests/slurm_local.py)
from conftest import wait_until  # noqa: E402
from test_objstore_slow import OPTS, _ingest, _records_per_block, reference  # noqa: E402,F401

pytestmark = pytest.mark.slow

OPTION_SECRET = "vsekit-option-secret-not-in-any-file"


def _options_only_with_the_tasks(s3, monkeypatch, cluster_config: dict) -> None:
    """The jobs run this checkout's src with ``cluster_config``; no AWS variable at all in their
    environment (the scheduler passes the submitting one): the endpoint and the credentials can reach
    them only with their tasks, as --storage-option gives them here."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({
        "interface": "lo", "cores": 1, "memory": "2GB", "walltime": "00:20:00", **cluster_config}))
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    from vsekit.storage import objstore

    monkeypatch.setattr(objstore, "DEFAULT_OPTIONS", {
        "endpoint": s3.endpoint, "access_key_id": "vsekit-test-key", "secret_access_key": OPTION_SECRET,
        "region": "us-east-1"})


def _extract_equals_disk_and_leaks_nothing(s3, url, cluster, reference, written_in) -> None:
    """``extract`` on ``cluster`` gives the disk run's bits with one record per block, and the option's
    secret is in no file under ``written_in`` (at least one file is there) and no object."""
    from vsekit.extract import extract
    from vsekit.storage.store import FeatureStore

    res = extract(url, cluster=cluster, device="cpu", **OPTS)
    fs = FeatureStore.open(url).features(res.name)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)                          # bit for bit as on disk
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}    # each block committed once
    written = [p for folder in written_in for p in folder.rglob("*") if p.is_file()]
    assert written
    for p in written:
        assert OPTION_SECRET.encode() not in p.read_bytes(), p
    for key in s3.keys():
        assert OPTION_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key


def test_slurm_jobs_get_the_storage_options_with_their_tasks_and_write_what_disk_has(
        local_slurm, s3, demo_dir, reference, tmp_path, monkeypatch):
    url = _ingest(s3, demo_dir)
    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    _options_only_with_the_tasks(s3, monkeypatch, {"queue": "vsekit", "python": sys.executable,
                                                   "log_directory": str(tmp_path / "jobs")})
    # the secret is in no file the run or SLURM wrote (job logs, SLURM's state and spool) and no object
    _extract_equals_disk_and_leaks_nothing(s3, url, "slurm:2", reference, [tmp_path / "jobs", local_slurm["dir"]])
    assert not slurm_local.jobs(local_slurm["env"])                       # the jobs ended with the run
    assert any((tmp_path / "jobs").rglob("*.err")) or any((tmp_path / "jobs").rglob("*.out"))


def test_grid_engine_jobs_get_the_storage_options_with_their_tasks_and_write_what_disk_has(
        local_sge, s3, demo_dir, reference, tmp_path, monkeypatch):
    """`sge:N` is the same dask-jobqueue path (its jobs see the submitting environment through
    ``qsub -V``): the same bits, one record per block, the option's secret in no job log or object."""
    import sge_local

    url = _ingest(s3, demo_dir)
    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, local_sge["env"][key])
    (tmp_path / "jobs").mkdir()
    _options_only_with_the_tasks(s3, monkeypatch, {"memory_resource": "h_rss", "queue": sge_local.QUEUE,
                                                   "python": sys.executable, "log_directory": str(tmp_path / "jobs")})
    _extract_equals_disk_and_leaks_nothing(s3, url, "sge:2", reference, [tmp_path / "jobs"])
    # the jobs ended with the run (qdel is asynchronous: they leave the queue within seconds), and their
    # logs are where log_directory put them
    wait_until(lambda: not sge_local.jobs(local_sge["env"]), 60, "the run's Grid Engine jobs to leave the queue")
    assert not sge_local.jobs(local_sge["env"])
    assert any(p.is_file() and p.stat().st_size for p in (tmp_path / "jobs").rglob("*"))


def test_a_cluster_that_does_not_serve_object_storage_is_refused_in_one_line(s3, demo_dir):
    """Every batch scheduler serves a store on object storage (pbs:N, lsf:N, htcondor:N on stand-ins:
    tests/test_jobqueue_standins.py); a job array serves extraction only
    (tests/test_objstore_array.py): the other stages refuse it in one line, before any work."""
    from click.testing import CliRunner

    from vsekit.cli import main

    url = _ingest(s3, demo_dir)
    for stage in ("standardize", "fne"):
        r = CliRunner().invoke(main, [stage, "--store", url, "--features", "test_resnet_fne", "--cluster", "slurm-array:2"])
        errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
        assert r.exit_code == 1 and len(errors) == 1, (stage, r.output)
        assert "in-process or on --cluster local:N / tcp:// / slurm:N / sge:N / pbs:N / lsf:N / htcondor:N for" in errors[0]
        assert url in errors[0]
    assert not [k for k in s3.keys() if "/features/" in k]


def test_fne_on_slurm_jobs_into_s3_equals_disk_with_the_options_only_in_the_tasks(
        local_slurm, s3, demo_dir, tmp_path, monkeypatch):
    """`fne --cluster slurm:2` into S3: its tasks get the URL's options as extraction's do (a handle in
    memory: tests/test_objstore_cluster.py); both sets equal `fne` in-process on disk, one commit record
    per block, the option's secret in no job log or object."""
    from vsekit.extract import extract
    from vsekit.fne import fne
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore

    disk, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "d.zarr")
    name = extract(disk, workers=0, **OPTS).name
    fne(disk, name)
    url = _ingest(s3, demo_dir)
    extract(url, workers=0, **OPTS)                            # in-process: the cluster runs fne only
    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    _options_only_with_the_tasks(s3, monkeypatch, {"queue": "vsekit", "python": sys.executable,
                                                   "log_directory": str(tmp_path / "jobs")})
    z, q = fne(url, name, cluster="slurm:2")
    assert (z.blocks_written, q.blocks_written) == (6, 6)
    a = FeatureStore.open(url)
    for suffix in (".z", ".z.fne"):
        for arr in ("data", "status"):
            assert np.array_equal(a.features(name + suffix).group[arr][:], disk.features(name + suffix).group[arr][:])
        records = [k for k in s3.keys() if f"/.vsekit/commits/{name}{suffix}/" in k]
        assert len(records) == 6                                 # one per block
    assert not slurm_local.jobs(local_slurm["env"])
    logs = [p for p in (tmp_path / "jobs").rglob("*") if p.is_file()]
    assert logs
    for p in logs:
        assert OPTION_SECRET.encode() not in p.read_bytes(), p
    for key in s3.keys():
        assert OPTION_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key
