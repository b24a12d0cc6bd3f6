"""The optional extras: vsekit works without numba ([fast]) and without dask-jobqueue ([slurm]),
and says which extra to install when a feature needs one."""

from __future__ import annotations

import subprocess
import sys

import pytest

HIDE = ("import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {mods!r}:\n"
        "            raise ImportError(f'{{name}} hidden by the test')\n"
        "sys.meta_path.insert(0, Hide())\n")


def _run(code: str, hide: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE.format(mods=set(hide)) + code], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_order_similarity_without_numba_matches_numpy():
    """numba hidden: every package imports, and order-violation scores (the numba kernel's job)
    equal an independent numpy computation."""
    code = (
        "import numpy as np, torch\n"
        "import vsekit.cli, vsekit.train, vsekit.extract, vsekit.fne, vsekit.tokenize\n"
        "from vsekit.models import kernels\n"
        "from vsekit.models.losses import order_sim\n"
        "assert not kernels.available() and 'numba' not in sys.modules\n"
        "rng = np.random.default_rng(0)\n"
        "img, cap = np.abs(rng.normal(size=(5, 8))).astype('f4'), np.abs(rng.normal(size=(6, 8))).astype('f4')\n"
        "with torch.no_grad():\n"
        "    got = order_sim(torch.from_numpy(img), torch.from_numpy(cap)).numpy()\n"
        "want = -(np.maximum(0, cap[None, :, :] - img[:, None, :]) ** 2).sum(-1)\n"
        "np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)\n"
        "print('ok')\n")
    res = _run(code, ("numba",))
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


def test_slurm_without_dask_jobqueue_names_the_extra():
    code = (
        "from vsekit.clusters import cluster_client\n"
        "try:\n"
        "    with cluster_client('slurm:1'):\n"
        "        pass\n"
        "except ValueError as exc:\n"
        "    print(exc)\n")
    res = _run(code, ("dask_jobqueue",))
    assert res.returncode == 0, res.stderr
    assert "vsekit[slurm]" in res.stdout and "dask-jobqueue" in res.stdout


def test_cluster_settings_refuse_unknown_keys(monkeypatch):
    pytest.importorskip("dask_jobqueue")
    from vsekit.clusters import cluster_client, cluster_settings, parse_cluster
    from vsekit.clusters.jobqueue import jobqueue_kwargs

    assert (parse_cluster("slurm:3", {}).kind, parse_cluster("slurm:3", {}).n) == ("slurm", 3)
    with pytest.raises(ValueError, match="slurm:N with N >= 1"):
        parse_cluster("slurm:0")
    with pytest.raises(ValueError, match="valid: queue, account"):
        cluster_settings({"partition": "gpu"})
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", '{"queue": "gpu", "gpus": 1, "cores": 8, "memory": "64GB"}')
    kw = jobqueue_kwargs("slurm", cluster_settings(), "cuda", {"GPU": 1})
    # the job gets the 8 cores (--cpus-per-task); its one GPU worker is pinned and runs one task at a time
    assert kw["queue"] == "gpu" and kw["job_cpu"] == 8 and kw["memory"] == "64GB" and kw["processes"] == 1
    assert kw["cores"] == 1 and "--gres=gpu:1" in kw["job_extra_directives"]
    # no walltime set: dask-jobqueue's default (00:30:00) is the job's, and the worker retires before it
    assert kw["worker_extra_args"] == ["--preload", "vsekit.cluster_pin", "--resources", "GPU=1",
                                       "--lifetime", "1620s", "--lifetime-stagger", "45s"]
    cpu = jobqueue_kwargs("slurm", {"cores": 4}, "cpu", None)  # one single-threaded worker per core, no GPU
    assert cpu["processes"] == 4 and not any("gres" in d for d in cpu["job_extra_directives"])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="`sbatch` is not on the PATH"):
        with cluster_client(parse_cluster("slurm:1", {})):
            pass
    monkeypatch.setenv("VSEKIT_CLUSTER_CONFIG", "{not json")
    with pytest.raises(ValueError, match="VSEKIT_CLUSTER_CONFIG"):
        cluster_settings()
