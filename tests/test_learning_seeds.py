"""Seed sweeps of the learning tests (issue 25): each test that asserts training progress, run for
seeds 0-19, so that its bar holds for the property ("it learns"), not for one seed's trajectory on
one CPU. Slow (``make test-slow``, or ``pytest -m slow tests/test_learning_seeds.py``); the normal
suite runs one seed of each.

The test modules pin torch to 1 thread on import; the sweep runs with ``OMP_NUM_THREADS`` threads
(``make test-slow``: 2), so running it with 1 and with 2 checks two reduction orders.

Worst seed of each sweep on an AMD EPYC (AVX-512) against its bar, with 1 and 2 threads; where
given, also with torch's AVX2 and scalar kernels (``ATEN_CPU_CAPABILITY=avx2`` / ``default``),
which round differently, as other CPUs do:

- SGR, R@1 on 12 pairs (chance 1/12), bar 0.5: worst 0.917 (avx2 / default kernels: 0.75).
- SMAN and SMAN-SIM, R@1 on 10 pairs (chance 1/10), bar 0.6: every seed 1.0 (also avx2 / default).
- demo preset, val rsum on 80 images (chance 39.3), bar max(3 x chance = 118, 2 x untrained):
  worst best rsum (1 thread / 2 threads) vse 172.5 / 172.5, order 165.5 / 165.5, seam-e
  215.2 / 215.2, seam-c 223.0 / 223.0, seam-g 174.2 / 170.0 (worst 1.40 x the bar). The untrained
  rsum ranges 24.8-57.8; the old bar, 3 x untrained, held here by 10% at worst (3.31 x, vse seed 14).

The whole sweep (160 cases) took 4 min 11 s with 1 thread on 2 shared cores (3 min 52 s of CPU),
13 min 41 s with 2 threads (``make test-slow``) while other jobs loaded the cores.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_sgraf import sgr_learns
from test_sman import sman_learns
from test_train_trainer import LEARNING_MODELS, build_store, chance_rsum, learns_the_demo_data

pytestmark = pytest.mark.slow

SEEDS = list(range(20))


@pytest.fixture(autouse=True)
def threads():
    """Run with OMP_NUM_THREADS threads (default 1), whatever the imported test modules set."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    path = build_store(tmp_path_factory.mktemp("seeds"))
    return path, chance_rsum(path)


@pytest.mark.parametrize("seed", SEEDS)
def test_sgr_learns_for_every_seed(seed):
    after, bar = sgr_learns(seed)
    assert after >= bar, (seed, after, bar)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["sman", "sman-sim"])
def test_sman_learns_for_every_seed(name, seed):
    after, bar = sman_learns(name, seed)
    assert after >= bar, (name, seed, after, bar)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("model", LEARNING_MODELS)
def test_every_model_learns_the_demo_data_for_every_seed(demo_store, tmp_path, model, seed):
    path, chance = demo_store
    best, bar, s = learns_the_demo_data(path, tmp_path / "run", model, seed, chance)
    assert best >= bar, (model, seed, bar, s)
