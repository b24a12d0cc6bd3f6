"""Shared fixtures: small demo datasets and stores that tests build themselves."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


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
