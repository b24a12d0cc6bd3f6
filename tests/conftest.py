"""Shared fixtures: small demo datasets and stores that tests build themselves."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


# What is slow. A test that takes over ~5 s on 2 idle cores (`--durations` shows it), or that starts a
# process cluster (dask local/tcp), SLURM, a kill-and-rerun sweep, or a long end-to-end run, is marked
# ``slow``: `make test` leaves it out, `.ci/run` runs it (`make test-slow`: every slow test not also
# marked ``paper``). The papers' full-dimension training cases are ``slow`` and ``paper``: `make
# test-paper` only (~30 min on 2 cores). Cover the same code in the default set with a small, fast case
# wherever one exists; nothing that guards correctness is dropped, only moved. (tests/README.md)
# End-to-end modules (CLI runs, extraction, training, subprocesses) carry ``e2e``: in `make test`, left
# out of `make test-fast`, the edit loop's quick pass over the library's units.
def pytest_configure(config):
    config.addinivalue_line("markers", "paper: the papers' full dimensions; also slow; `make test-paper` only, not in CI")
    config.addinivalue_line("markers", "e2e: an end-to-end module; in `make test`, not in `make test-fast`")


# `make test-slow` runs in several pytest processes (pytest-xdist, `-n 3 --dist loadfile`): most slow
# tests wait on a scheduler, a job or a killed process, not a CPU. A module's tests stay in one
# process (its module fixtures, a SLURM among them, start once), and every module that uses the Grid
# Engine (names tests/sge_local.py or the `local_sge` fixture) shares one process: the cell is one per
# machine, and a module's teardown deletes every job and stops the daemons (tests/sge_local.py).
@pytest.hookimpl(tryfirst=True, optionalhook=True)   # before xdist's choice; none without xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleOrGridEngine(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "gridengine" if uses_grid_engine(config.rootpath / module) else module

    return ModuleOrGridEngine(config, log)


@functools.lru_cache(maxsize=None)
def uses_grid_engine(module) -> bool:
    """Whether the test module at ``module`` starts or uses the machine's one Grid Engine cell."""
    text = module.read_text() if module.is_file() else ""
    return "sge_local" in text or "local_sge" in text


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    """A 24-image synthetic dataset (Karpathy JSON, JPEGs, boxes.json)."""
    from vsekit.storage.demo import make_demo_data

    out = tmp_path_factory.mktemp("demo")
    make_demo_data(out, images=24, seed=1, size=64)
    return out


@pytest.fixture()
def demo_store(demo_dir, tmp_path):
    """A fresh store ingested from ``demo_dir`` (20 train/2 val/2 test... by the demo's fractions)."""
    from vsekit.storage.sources.karpathy import ingest_karpathy

    store, _ = ingest_karpathy(demo_dir / "dataset_demo.json", demo_dir, tmp_path / "demo.zarr")
    return store


def make_region_store(path, *, n_train: int, n_val: int, per_image: int, regions: int, channels: int,
                      name: str = "regions"):
    """A tokenised store of random region features (train / val / test = n_train / n_val / n_val
    images, ``per_image`` captions of 2-5 words each, 2..K valid regions per image), for training tests."""
    from vsekit.storage.store import FeatureStore
    from vsekit.tokenize import tokenize

    rng = np.random.default_rng(0)
    n = n_train + 2 * n_val
    store = FeatureStore.create(path, dataset=name)
    store.write_images([f"im{i}" for i in range(n)], [f"{i}.jpg" for i in range(n)],
                       ["train"] * n_train + ["val"] * n_val + ["test"] * n_val)
    rows = np.repeat(np.arange(n), per_image)
    words = [f"w{i}" for i in range(30)]
    store.write_captions([" ".join(rng.choice(words, rng.integers(2, 6))) for _ in rows], rows)
    tokenize(store, min_count=1)
    k, c = regions, channels
    fs = store.create_features(name, (k, c), "float32", block_rows=32, attrs={"kind": "regions"},
                               extra={"count": ((), "int32")})
    for b in fs.blocks():
        data = rng.standard_normal((len(b), k, c), dtype=np.float32)
        counts = rng.integers(2, k + 1, len(b)).astype(np.int32)
        data[np.arange(k)[None, :] >= counts[:, None]] = 0
        fs.write_block(b, data, count=counts)
    return str(path)


@pytest.fixture()
def float64():
    """torch's default dtype is float64 for the test: modules, ``randn``, ``zeros`` made inside it are
    float64. For tests that check a formula against an independent computation: float32 rounding
    differs between CPUs (Intel, AMD, AVX2 / AVX-512 kernels) and thread counts by more than any fixed
    float32 tolerance allows, float64 rounding is far below the tolerances these tests use."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield torch.float64
    torch.set_default_dtype(before)


# --- object storage (issue 35): a local S3 server, one bucket per test --------------------------
S3_TEST_SECRET = "vsekit-test-secret-0a1b2c3d4e5f"   # tests look for it wherever it must not be


@pytest.fixture(scope="session")
def moto_endpoint():
    """``moto[server]``'s ThreadedMotoServer on 127.0.0.1 and a free port, for the whole session."""
    pytest.importorskip("obstore")
    server_mod = pytest.importorskip("moto.server")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)   # a line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def s3(moto_endpoint, monkeypatch):
    """A fresh bucket on the local S3 server, with the standard AWS variables pointing at it.
    ``s3.url(name)`` is an ``s3://`` URL in it; ``s3.client`` a boto3 client (for checks only)."""
    import types
    import uuid

    import boto3

    from vsekit.storage import objstore

    env = {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "vsekit-test-key",
           "AWS_SECRET_ACCESS_KEY": S3_TEST_SECRET, "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(objstore, "DEFAULT_OPTIONS", {})
    monkeypatch.setattr(objstore, "_PROBED", {})
    bucket = f"vsekit-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    client.create_bucket(Bucket=bucket)

    def keys(prefix=""):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    return types.SimpleNamespace(endpoint=moto_endpoint, bucket=bucket, client=client, env=env, keys=keys,
                                 url=lambda name="x.zarr": f"s3://{bucket}/{name}")


# --- batch schedulers on this machine (tests/slurm_local.py, tests/sge_local.py) -------------------
@pytest.fixture(scope="module")
def local_slurm(tmp_path_factory):
    """A running one-node SLURM on 127.0.0.1 for a module's tests: ``{"env": its clients' environment,
    "dir": its folder}``; skipped with the reason where it cannot run (no slurm-wlm, not root)."""
    import slurm_local

    why = slurm_local.unavailable()
    if why:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("slurm")
    with slurm_local.local_slurm(folder) as env:
        yield {"env": env, "dir": folder}


@pytest.fixture(scope="module")
def local_sge():
    """A running one-node Grid Engine for a module's tests: ``{"env": its clients' environment}``."""
    import sge_local

    why = sge_local.unavailable()
    if why:
        pytest.skip(why)
    with sge_local.local_sge() as env:
        yield {"env": env}


def wait_until(cond, timeout: float, what: str, every: float = 0.1):
    """``cond()``'s first true value, polled every ``every`` s; an AssertionError naming ``what`` after
    ``timeout`` s."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
