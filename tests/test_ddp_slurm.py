"""Data-parallel training under SLURM's ``srun`` (slow: starts the single-node SLURM of
tests/slurm_local.py; skipped where slurm-wlm and munge are not installed).

A 2-task job step (``srun --ntasks 2``) of plain ``vsekit train``: each task joins the group from
SLURM's variables (``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``, the master from the step's
node list), and the run's weights and log equal one process's at the same global batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_ddp_cli import assert_same_weights, base, log, single, store_path  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow

import slurm_local  # noqa: E402  (tests/slurm_local.py)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = slurm_local.unavailable() or (None if slurm_local.which("srun") else "srun is not installed here")
    if why:
        pytest.skip(why)
    with slurm_local.local_slurm(tmp_path_factory.mktemp("slurm")) as env:
        yield env


def test_two_srun_tasks_train_the_one_process_model(slurm, store_path, single, tmp_path):  # noqa: F811
    out = tmp_path / "srun"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**slurm, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([slurm_local.which("srun"), "--ntasks", "2", "--nodes", "1", "--cpus-per-task", "1",
                          "--export", "ALL", "--time", "10", sys.executable, "-m", "vsekit.cli",
                          *base(store_path, out, "--collective-timeout", "120")], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "data-parallel over 2 ranks (gloo)" in res.stdout
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt")
    assert [e["epoch"] for e in log(out)] == [0, 1, 2, 3]
    assert json.loads((out / "config.json").read_text())["train"]["batch_size"] == 8
