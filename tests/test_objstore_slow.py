"""Object storage (issue 35) with processes: a local:2 cluster, a worker killed between its chunk
writes and its commit record, a driver killed there and resumed, and a driver paused past its lease
while another run takes the set over. Against the local S3 server (the ``s3`` fixture)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto")
pytest.importorskip("distributed")

from click.testing import CliRunner  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.storage import integrity, objcommit  # noqa: E402
from vsekit.storage.store import FeatureStore  # noqa: E402

pytestmark = pytest.mark.slow

OPTS = dict(model="test_resnet", kind="fne", weights="none", seed=3, input_size=64, resize=72,
            crops=1, batch_size=2, block_rows=4, progress=False)
ARGS = ["--model", "test_resnet", "--weights", "none", "--kind", "fne", "--seed", "3", "--crops", "1",
        "--input-size", "64", "--resize", "72", "--batch-size", "2", "--block-rows", "4", "--no-progress"]
NAME = "test_resnet_fne"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_dir):
    """The same extraction on a local disk, in-process with one torch thread (as dask workers run)."""
    import torch

    from vsekit.extract import extract
    from vsekit.storage.sources.karpathy import ingest_karpathy

    torch.set_num_threads(1)
    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir,
                               tmp_path_factory.mktemp("ref") / "ref.zarr")
    res = extract(store, workers=0, **OPTS)
    return store.features(res.name).data[:]


def _ingest(s3, demo_dir) -> str:
    from vsekit.storage.sources.karpathy import ingest_karpathy

    ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, s3.url())
    return s3.url()


def _records_per_block(s3) -> dict[int, int]:
    counts: dict[int, int] = {}
    for key in s3.keys():
        if f"/.vsekit/commits/{NAME}/" in key:
            block = int(key.rsplit("/", 1)[1].split(".")[0])
            counts[block] = counts.get(block, 0) + 1
    return counts


def _cli(args, env_extra=None, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-c", "from vsekit.cli import main; main()", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def test_local_cluster_on_s3_equals_disk_and_a_killed_worker_loses_and_doubles_nothing(s3, demo_dir, reference):
    """Every worker process dies at its second commit record (after that block's chunks are written):
    the scheduler runs the block again on another worker, and every block ends with one record and the
    bits of the in-process run on disk."""
    url = _ingest(s3, demo_dir)
    proc = _cli(["extract", "--store", url, *ARGS, "--cluster", "local:2"],
                {"VSEKIT_FAULT": "objstore:record@2"})
    out = proc.communicate(timeout=400)[0].decode()
    assert proc.returncode == 0, out
    assert "died during the run" in out, out                 # the fault did kill workers
    fs = FeatureStore.open(url).features(NAME)
    assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert integrity.verify(fs).ok


def test_a_driver_killed_between_chunks_and_record_resumes_with_nothing_lost_or_written_twice(s3, demo_dir, reference):
    url = _ingest(s3, demo_dir)
    proc = _cli(["extract", "--store", url, *ARGS, "--workers", "0"], {"VSEKIT_FAULT": "objstore:record@3"})
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 137, out
    fs = FeatureStore.open(url).features(NAME)
    assert _records_per_block(s3) == {0: 1, 1: 1}                     # block 2: chunks, no record
    assert any(k.endswith(f"features/{NAME}/data/c/2/0") for k in s3.keys())
    assert fs.counts()["done"] == 8
    first = {i: s3.client.head_object(Bucket=s3.bucket, Key=f"x.zarr/features/{NAME}/data/c/{i}/0")["LastModified"]
             for i in (0, 1)}
    before = objcommit.records(fs)
    time.sleep(1.1)   # S3 times have whole seconds: a rewrite would show
    r = CliRunner().invoke(main, ["extract", "--store", url, *ARGS, "--workers", "0"])
    assert r.exit_code == 0, r.output      # the dead driver's lease (this host, pid gone) is taken at once
    assert "skipped 2 already done" in r.output, r.output
    fs = FeatureStore.open(url).features(NAME)
    assert np.array_equal(fs.data[:], reference)
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    after = objcommit.records(fs)
    assert all(after[i] == before[i] for i in (0, 1))                 # the first run's records, kept
    for i in (0, 1):                                                   # and its chunks, not rewritten
        assert s3.client.head_object(Bucket=s3.bucket, Key=f"x.zarr/features/{NAME}/data/c/{i}/0")["LastModified"] == first[i]


def test_a_driver_paused_past_its_lease_commits_nothing_after_another_run_took_the_set(s3, demo_dir, reference, tmp_path):
    url = _ingest(s3, demo_dir)
    flag = tmp_path / "go"
    proc = _cli(["extract", "--store", url, *ARGS, "--workers", "0"],
                {"VSEKIT_LEASE_TTL_S": "3", "VSEKIT_PAUSE": "objstore:record@2", "VSEKIT_PAUSE_FILE": str(flag)})
    deadline = time.time() + 120
    while not (tmp_path / "go.reached").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (tmp_path / "go.reached").exists(), proc.communicate()[0].decode()
    os.kill(proc.pid, signal.SIGSTOP)          # the whole process, its lease renewals too
    try:
        r = CliRunner().invoke(main, ["extract", "--store", url, *ARGS, "--workers", "0"])
        assert r.exit_code == 1 and "is being written by another run" in r.output   # not expired yet
        time.sleep(3.5)
        r = CliRunner().invoke(main, ["extract", "--store", url, *ARGS, "--workers", "0"])
        assert r.exit_code == 0, r.output
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        flag.touch()
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 1 and "lost the lease" in out, out
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, out
    fs = FeatureStore.open(url).features(NAME)
    recs = objcommit.records(fs)
    assert sorted(recs) == [b.index for b in fs.blocks()] and _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    tokens = {i: rec["token"] for i, rec in recs.items()}
    assert len(set(tokens.values())) == 2 and all(tokens[i] == tokens[1] for i in tokens if i >= 1)
    assert np.array_equal(fs.data[:], reference)
    assert integrity.verify(fs).ok


def test_a_server_gone_mid_run_is_one_error_after_bounded_retries_and_a_rerun_completes(
        s3, demo_dir, reference, tmp_path, monkeypatch):
    """The S3 server goes away between a block's chunk writes and its commit record: the run retries
    with backoff (here 1 retry within 2 s), stops with one Error line naming the URL, and once the
    server is back a rerun completes with one record per block and the bits of the run on disk."""
    import threading

    from moto.server import ThreadedMotoServer

    from vsekit.storage import faults

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)   # its own, to stop
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")   # moto's buckets are shared in-process
    monkeypatch.setenv("VSEKIT_LEASE_TTL_S", "2")
    url = _ingest(s3, demo_dir)
    flag = tmp_path / "go"
    monkeypatch.setattr(faults, "_config", ("", f"objstore:record@3={flag}"))
    opts = [*ARGS, "--workers", "0", "--storage-option", "max_retries=1", "--storage-option", "retry_timeout=2"]
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=CliRunner().invoke(main, ["extract", "--store", url, *opts])))
    thread.start()
    deadline = time.time() + 120
    while not (tmp_path / "go.reached").exists() and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    server.stop()                                   # gone between block 2's chunks and its record
    flag.touch()
    thread.join(120)
    r = result["r"]
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1 and url in errors[0], r.output
    assert "refused the connection" in errors[0] or "cannot be reached" in errors[0], errors
    monkeypatch.setattr(faults, "_config", False)
    back = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    back.start()
    try:
        assert _records_per_block(s3) == {0: 1, 1: 1}
        time.sleep(2.5)                             # the failed run's lease (this live process) expires
        r = CliRunner().invoke(main, ["extract", "--store", url, *opts])
        assert r.exit_code == 0 and "skipped 2 already done" in r.output, r.output
        fs = FeatureStore.open(url).features(NAME)
        assert np.array_equal(fs.data[:], reference)
        assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    finally:
        back.stop()


def test_a_tcp_cluster_gets_the_storage_options_with_its_tasks(s3, demo_dir, reference, tmp_path, monkeypatch):
    """Workers started elsewhere (`dask worker`) with no AWS variables at all: the endpoint and the
    credentials reach them with the job (in memory), and the extraction equals the one on disk."""
    from test_extract_cluster import tcp_cluster

    from vsekit.extract import extract
    from vsekit.storage import objstore

    url = _ingest(s3, demo_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with tcp_cluster(tmp_path / "dask.log", workers=2, env=env) as (addr, _procs):
        monkeypatch.setattr(objstore, "DEFAULT_OPTIONS", {   # as --storage-option gives them
            "endpoint": s3.endpoint, "access_key_id": "vsekit-test-key",
            "secret_access_key": s3.env["AWS_SECRET_ACCESS_KEY"], "region": "us-east-1"})
        res = extract(url, cluster=addr, **OPTS)
        fs = FeatureStore.open(url).features(res.name)
        assert fs.counts() == {"pending": 0, "done": 24, "failed": 0}
        assert np.array_equal(fs.data[:], reference)
        assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in (tmp_path / "dask.log").read_text()


def test_an_extract_overwrite_killed_in_its_swap_is_named_to_readers_and_finished_by_the_next_run(
        s3, demo_dir, reference):
    """``kill -9`` of an ``extract --overwrite`` after the old set's objects are deleted, before the new
    ones are copied in: a reader gets one error naming the swap; the next extract of the set (here
    without --overwrite, with the new settings) takes the dead run's lease, finishes the swap and finds
    every block done: the new set whole, the bits of a fresh extraction, nothing of the old one left."""
    url = _ingest(s3, demo_dir)
    old_args = [("80" if a == "72" else a) for a in ARGS]            # the old set: --resize 80
    assert CliRunner().invoke(main, ["extract", "--store", url, *old_args, "--workers", "0"]).exit_code == 0
    old_gen = FeatureStore.open(url).features(NAME).attrs["generation"]
    proc = _cli(["extract", "--store", url, *ARGS, "--workers", "0", "--overwrite"], {"VSEKIT_FAULT": "replace:copy"})
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 137, out
    r = CliRunner().invoke(main, ["info", url, NAME])
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert r.exit_code == 1 and len(errors) == 1 and "is being replaced" in errors[0], r.output
    r = CliRunner().invoke(main, ["extract", "--store", url, *ARGS, "--workers", "0"])
    assert r.exit_code == 0 and "skipped 6 already done" in r.output, r.output
    fs = FeatureStore.open(url).features(NAME)
    assert np.array_equal(fs.data[:], reference) and fs.attrs["resize"] == 72
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert integrity.verify(fs).ok
    assert not [k for k in s3.keys() if old_gen in k or ".next-" in k or "/.vsekit/swaps/" in k
                or "/.vsekit/leases/" in k]


def test_an_ingest_overwrite_killed_in_its_swap_is_finished_by_the_next_one(s3, demo_dir, tmp_path):
    """``kill -9`` of ``ingest --overwrite`` of a whole store in its copy: opening the URL names the
    swap; the next ``ingest --overwrite`` finishes it, then makes its own store (the one disk has)."""
    from test_objstore_ingest import _assert_same, _contents

    url, disk = s3.url("stores/demo.zarr"), str(tmp_path / "d.zarr")
    karpathy = ["ingest", "karpathy", str(demo_dir / "dataset_demo.json")]
    assert CliRunner().invoke(main, [*karpathy, "--store", url]).exit_code == 0
    assert CliRunner().invoke(main, [*karpathy, "--store", disk, "--restval-as-train"]).exit_code == 0
    proc = _cli([*karpathy, "--store", url, "--overwrite", "--restval-as-train"],
                {"VSEKIT_FAULT": "ingest:replace:copy"})
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 137, out
    r = CliRunner().invoke(main, ["info", url])
    assert r.exit_code == 1 and "is being replaced by `vsekit ingest ... --overwrite`" in r.output, r.output
    r = CliRunner().invoke(main, [*karpathy, "--store", url, "--overwrite", "--restval-as-train"])
    assert r.exit_code == 0, r.output     # the dead run's store lease (this host, pid gone) is taken at once
    _assert_same(_contents(url), _contents(disk))
    assert not [k for k in s3.keys() if "/.vsekit/" in k]


def test_extract_overwrite_on_a_local_cluster_on_s3_equals_disk(s3, demo_dir, reference):
    """--overwrite with dask workers: each task opens the staged set by its hidden name and commits its
    block under the driver's lease of the set it replaces; the swapped-in set equals the run on disk."""
    url = _ingest(s3, demo_dir)
    old_args = [("80" if a == "72" else a) for a in ARGS]
    assert CliRunner().invoke(main, ["extract", "--store", url, *old_args, "--workers", "0"]).exit_code == 0
    old_gen = FeatureStore.open(url).features(NAME).attrs["generation"]
    proc = _cli(["extract", "--store", url, *ARGS, "--cluster", "local:2", "--overwrite"])
    out = proc.communicate(timeout=400)[0].decode()
    assert proc.returncode == 0, out
    fs = FeatureStore.open(url).features(NAME)
    assert np.array_equal(fs.data[:], reference) and fs.attrs["generation"] != old_gen
    assert _records_per_block(s3) == {b.index: 1 for b in fs.blocks()}
    assert integrity.verify(fs).ok
    assert not [k for k in s3.keys() if old_gen in k or ".next-" in k or "/.vsekit/swaps/" in k]
