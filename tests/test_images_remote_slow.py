"""Images on object storage read by a local dask cluster and by job-array tasks (issue 46): the local
SLURM and Grid Engine with the store on S3 and its image root only on S3 (the store names no local
folder), the images' own options (``--image-option``) reaching the tasks with neither them nor the
store's in any file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")
pytestmark = pytest.mark.slow

from conftest import wait_until as _wait  # noqa: E402
from test_images_remote import counted, shards_on_s3, upload  # noqa: E402,F401
from test_objstore_array import _leaks_nothing, _on_cluster, _slurm_array_ended  # noqa: E402
from test_objstore_azure import az, azurite  # noqa: E402,F401
from test_objstore_slow import OPTS, reference  # noqa: E402,F401

IMAGE_SECRET = "vsekit-image-option-secret-in-no-file"


def _images_on_s3(s3, demo_dir, monkeypatch):
    """A store on S3 whose image root is s3://bucket/demo, read with options of their own."""
    from vsekit.storage import objstore
    from vsekit.storage.sources import remote
    from vsekit.storage.sources.karpathy import ingest_karpathy

    upload(s3, demo_dir / "images", "demo/images")
    monkeypatch.setattr(remote, "IMAGE_OPTIONS", {**objstore.DEFAULT_OPTIONS, "secret_access_key": IMAGE_SECRET})
    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", f"s3://{s3.bucket}/demo", s3.url())
    assert store.attrs["image_root"] == f"s3://{s3.bucket}/demo"
    return s3.url()


def test_slurm_and_grid_engine_arrays_read_images_only_on_s3_as_disk(local_slurm, local_sge, s3, demo_dir,
                                                                     reference, tmp_path, monkeypatch):
    import sge_local

    from vsekit.extract import extract
    from vsekit.storage.store import FeatureStore

    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, local_sge["env"][key])
    _on_cluster(s3, monkeypatch, tmp_path, {"queue": "vsekit"})
    url = _images_on_s3(s3, demo_dir, monkeypatch)
    sub = extract(url, cluster="slurm-array:2", device="cpu", name="on_slurm", **OPTS)
    _wait(lambda: _slurm_array_ended(local_slurm["env"], sub.job_id), 400, f"array {sub.job_id} to end")
    config = json.loads(os.environ["VSEKIT_CLUSTER_CONFIG"])
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", json.dumps({**config, "queue": sge_local.QUEUE,
                                                            "memory_resource": "h_rss"}))
    try:
        sub = extract(url, cluster="sge-array:2", device="cpu", name="on_sge", **OPTS)
        _wait(lambda: FeatureStore.open(url).features("on_sge").counts()["pending"] == 0, 400,
              f"array {sub.job_id} to commit every block")
    finally:
        sge_local.delete_all(local_sge["env"])
    store = FeatureStore.open(url)
    logs = "".join(p.read_text() for p in (tmp_path / "jobs").rglob("*") if p.is_file() and p.suffix != ".sh")
    for name in ("on_slurm", "on_sge"):
        fs = store.features(name)
        assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}, logs
        assert np.array_equal(fs.data[:], reference)   # bit for bit as the same images on disk
    _leaks_nothing(s3, [tmp_path])
    for p in tmp_path.rglob("*"):
        assert not p.is_file() or IMAGE_SECRET.encode() not in p.read_bytes(), p
    for key in s3.keys():
        assert IMAGE_SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key


def test_slurm_jobs_read_images_only_on_s3_with_their_options_in_memory(local_slurm, s3, demo_dir, reference,
                                                                        tmp_path, monkeypatch):
    """`slurm:2` (dask-jobqueue, as `sge:N`): no AWS variable in the jobs' environment; the store's and
    the images' options reach them with their tasks only, and no file holds either secret."""
    import sys

    from test_objstore_slurm import _extract_equals_disk_and_leaks_nothing, _options_only_with_the_tasks

    monkeypatch.setenv("SLURM_CONF", local_slurm["env"]["SLURM_CONF"])
    _options_only_with_the_tasks(s3, monkeypatch, {"queue": "vsekit", "python": sys.executable,
                                                   "log_directory": str(tmp_path / "jobs")})
    url = _images_on_s3(s3, demo_dir, monkeypatch)
    # the session's SLURM also keeps other tests' jobs (an array's job environment, by design, holds
    # its options: extract/array.py, OPTIONS_ENV): this test's files are those written since it began
    before = _stamps(local_slurm["dir"])
    _extract_equals_disk_and_leaks_nothing(s3, url, "slurm:2", reference, [tmp_path / "jobs", local_slurm["dir"]])
    slurm_files = [q for q, t in _stamps(local_slurm["dir"]).items() if before.get(q) != t]
    for p in [*tmp_path.rglob("*"), *slurm_files]:
        assert not p.is_file() or IMAGE_SECRET.encode() not in p.read_bytes(), p


def _stamps(folder) -> dict:
    """Each file under ``folder`` with its modification time (SLURM's spool files come and go)."""
    out = {}
    for q in folder.rglob("*"):
        try:
            if q.is_file():
                out[q] = q.stat().st_mtime_ns
        except FileNotFoundError:
            pass
    return out


def test_grid_engine_jobs_read_images_only_on_s3_with_their_options_in_memory(local_sge, s3, demo_dir, reference,
                                                                              tmp_path, monkeypatch):
    """`sge:2`, as `slurm:2` above (its jobs see the submitting environment through ``qsub -V``, which
    holds no AWS variable)."""
    import sys

    import sge_local
    from test_objstore_slurm import _extract_equals_disk_and_leaks_nothing, _options_only_with_the_tasks

    for key in ("SGE_ROOT", "SGE_CELL"):
        monkeypatch.setenv(key, local_sge["env"][key])
    (tmp_path / "jobs").mkdir()
    _options_only_with_the_tasks(s3, monkeypatch, {"memory_resource": "h_rss", "queue": sge_local.QUEUE,
                                                   "python": sys.executable, "log_directory": str(tmp_path / "jobs")})
    url = _images_on_s3(s3, demo_dir, monkeypatch)
    _extract_equals_disk_and_leaks_nothing(s3, url, "sge:2", reference, [tmp_path / "jobs"])
    _wait(lambda: not sge_local.jobs(local_sge["env"]), 60, "the run's Grid Engine jobs to leave the queue")
    for p in tmp_path.rglob("*"):
        assert not p.is_file() or IMAGE_SECRET.encode() not in p.read_bytes(), p


def test_a_local_dask_cluster_reads_shards_on_s3_as_disk(shards_on_s3, tmp_path):
    from test_images_remote import EXTRACT

    from vsekit.extract import extract
    from vsekit.storage.store import FeatureStore

    _truth, disk, _url = shards_on_s3
    _on_disk_at_one_thread(disk)
    got = extract(str(tmp_path / "mixed.zarr"), name="f", cluster="local:2", device="cpu", **EXTRACT)
    assert got.failed == 0 and got.done == 30
    a, b = FeatureStore.open(disk).features("f"), FeatureStore.open(tmp_path / "mixed.zarr").features("f")
    assert np.array_equal(a.data[:], b.data[:])


def test_a_tcp_dask_cluster_reads_shards_on_s3_as_disk_with_the_image_options_in_memory(s3, shards_on_s3, counted,
                                                                                        tmp_path):
    from test_extract_cluster import tcp_cluster
    from test_images_remote import EXTRACT, FaultyProxy

    from vsekit.extract import extract
    from vsekit.storage.store import FeatureStore

    _truth, disk, url = shards_on_s3   # the store on S3, its images only on S3
    _on_disk_at_one_thread(disk)
    proxy = FaultyProxy(s3.endpoint)   # the images' endpoint, given to the task in memory only
    counted.use_options({"endpoint": proxy.url})
    try:
        with tcp_cluster(tmp_path / "dask.log", workers=1) as (addr, _procs):
            got = extract(url, name="f", cluster=addr, device="cpu", **EXTRACT)
    finally:
        proxy.server.shutdown()
    assert got.failed == 0 and got.done == 30
    a, b = FeatureStore.open(disk).features("f"), FeatureStore.open(url).features("f")
    assert np.array_equal(a.data[:], b.data[:])
    assert proxy.gets > 0   # the worker's GETs went where the options in memory said


def test_webdataset_shards_on_azure_ingest_once_and_extract_as_disk(az, tmp_path, monkeypatch):
    import obstore
    from click.testing import CliRunner
    from test_formats_webdataset import write_shards
    from test_images_remote import EXTRACT

    from vsekit.cli import main
    from vsekit.extract import extract
    from vsekit.storage.sources import remote
    from vsekit.storage.store import FeatureStore

    monkeypatch.setattr(remote, "_STORES", {})
    write_shards(tmp_path / "wds", n_shards=2, per_shard=6)
    root = az.url("laion")
    for f in sorted((tmp_path / "wds").glob("*.tar")):
        store, key = remote.store_of(f"{root}/{f.name}")
        obstore.put(store, key, f.read_bytes())
    for src, dest in ((str(tmp_path / "wds" / "shard-{0000..0001}.tar"), tmp_path / "disk.zarr"),
                      (f"{root}/shard-{{0000..0001}}.tar", tmp_path / "az.zarr")):
        r = CliRunner().invoke(main, ["ingest", "webdataset", src, "--store", str(dest), "--split", "train"])
        assert r.exit_code == 0, r.output
    assert FeatureStore.open(tmp_path / "az.zarr").attrs["image_root"] == root
    for dest in ("disk.zarr", "az.zarr"):
        assert extract(str(tmp_path / dest), name="f", workers=0, **EXTRACT).done == 12
    a, b = (FeatureStore.open(tmp_path / d).features("f").data[:] for d in ("disk.zarr", "az.zarr"))
    assert np.array_equal(a, b)


def test_decoding_processes_of_images_on_s3_end_when_the_main_process_is_killed(s3, demo_dir, tmp_path):
    """As tests/test_decoding_workers.py on disk: after ``kill -9`` of the extract, its fork server and
    the decoding processes it started end by themselves."""
    from test_decoding_workers import held_mid_run, killed_leaves_no_child

    from vsekit.storage.sources.karpathy import ingest_karpathy

    upload(s3, demo_dir / "images", "demo/images")
    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", f"s3://{s3.bucket}/demo", tmp_path / "k.zarr")
    proc, children = held_mid_run(store.path, tmp_path / "go", "--input-size", "128", "--resize", "128")
    assert any("forkserver" in " ".join(p.cmdline()) for p in children), [p.cmdline() for p in children]
    assert killed_leaves_no_child(proc, children) == []


def _on_disk_at_one_thread(disk) -> None:
    """Set ``f`` of the store on disk, extracted in-process at one thread, as dask workers run (the same
    float32 sums): the reference a cluster's extraction equals bit for bit."""
    import torch
    from test_images_remote import EXTRACT

    from vsekit.extract import extract

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        extract(str(disk), name="f", workers=0, **EXTRACT)
    finally:
        torch.set_num_threads(threads)
