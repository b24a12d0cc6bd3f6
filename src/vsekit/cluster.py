"""Where stages run: in-process, a local dask cluster (``local:N``), SLURM jobs (``slurm:N``) or a
running scheduler (``tcp://``).

Only this module imports ``distributed`` (and ``dask_jobqueue``), and only when a cluster is asked for.

- ``local:N`` starts N single-threaded worker processes on 127.0.0.1. With a CUDA device each worker
  is pinned to one GPU (``CUDA_VISIBLE_DEVICES``, round-robin, see :func:`vsekit.devices.gpu_assignment`)
  and declares the resource ``GPU=1``, so one task at a time runs per GPU.
- ``slurm:N`` submits N SLURM jobs through dask-jobqueue's ``SLURMCluster`` (``pip install
  vsekit[slurm]``), each running one dask worker. Queue, account, walltime, cores, memory and GPUs
  per job come from ``settings`` or, for ``vsekit run``, the ``cluster:`` section of pipelines.yaml
  (passed as JSON in ``$VSEKIT_CLUSTER_CONFIG``); dask-jobqueue's own config file fills the rest.
- ``tcp://HOST:PORT`` joins a scheduler whose workers were started elsewhere (``dask worker ...
  --resources GPU=1`` for GPU workers).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping

from .devices import gpu_assignment, is_cuda

SPEC_HELP = "local:N, slurm:N or tcp://HOST:PORT"
ENV_SETTINGS = "VSEKIT_CLUSTER_CONFIG"
# the keys of a `cluster:` section (pipelines.yaml) and of `settings`, with what they mean
SLURM_KEYS = {
    "queue": "SLURM partition (-p)",
    "account": "SLURM account (-A)",
    "walltime": "job time limit, HH:MM:SS (-t)",
    "cores": "CPU cores per job (and decoding threads of its worker)",
    "memory": "memory per job, e.g. 16GB",
    "gpus": "GPUs per job (--gres=gpu:G); the job's worker declares GPU=G",
    "processes": "dask worker processes per job (default: cores on CPU, 1 with a GPU)",
    "host": "address the scheduler listens on (default: dask-jobqueue's choice)",
    "interface": "network interface of scheduler and workers, e.g. ib0",
    "python": "python executable on the nodes (default: this one)",
    "log_directory": "folder for the jobs' stdout/stderr",
    "local_directory": "fast node-local scratch folder for the workers",
    "job_extra": "extra #SBATCH lines, a list (e.g. ['--constraint=a100'])",
    "prologue": "shell lines run before the worker, a list (e.g. ['module load cuda'])",
}


def parse_cluster(spec: str | None) -> tuple[str, Any] | None:
    """``None``/``""`` → None; ``local:N`` → ("local", N); ``slurm:N`` → ("slurm", N);
    ``tcp://HOST:PORT`` → ("tcp", address)."""
    if not spec:
        return None
    if spec.startswith("slurm-array:"):   # extract only: vsekit.extract.array
        n = int(spec.split(":", 1)[1]) if spec.split(":", 1)[1].isdigit() else 0
        if n < 1:
            raise ValueError(f"--cluster {spec!r}: expected slurm-array:N with N >= 1 array tasks")
        return "slurm-array", n
    for kind in ("local", "slurm"):
        if spec.startswith(f"{kind}:"):
            try:
                n = int(spec.split(":", 1)[1])
            except ValueError:
                n = 0
            if n < 1:
                what = "worker processes" if kind == "local" else "SLURM jobs"
                raise ValueError(f"--cluster {spec!r}: expected {kind}:N with N >= 1 {what}")
            return kind, n
    if spec.startswith("tcp://"):
        return "tcp", spec
    raise ValueError(f"--cluster {spec!r}: expected {SPEC_HELP}")


def cluster_settings(settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``settings``, else the JSON in ``$VSEKIT_CLUSTER_CONFIG``, checked against :data:`SLURM_KEYS`."""
    if settings is None:
        raw = os.environ.get(ENV_SETTINGS)
        try:
            settings = json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"${ENV_SETTINGS} is not JSON: {exc}") from None
    if not isinstance(settings, Mapping):
        raise ValueError(f"cluster settings must be a mapping of {', '.join(SLURM_KEYS)}")
    out = {}
    for key, value in settings.items():
        k = str(key).replace("-", "_")
        if k not in SLURM_KEYS:
            raise ValueError(f"cluster setting {key!r} is unknown; valid: {', '.join(SLURM_KEYS)}")
        out[k] = value
    return out


# --- local:N ----------------------------------------------------------------------------------------
def local_worker_env(n_workers: int, device: str, n_gpus: int | None = None,
                     visible: str | None = None) -> list[dict[str, str]]:
    """The extra environment of each local worker: its own GPU on a CUDA device, nothing on CPU.

    ``visible`` is this process's ``CUDA_VISIBLE_DEVICES`` (default: from the environment); GPU k of
    the assignment is the k-th visible one, so a job already restricted to GPUs "2,3" uses 2 and 3.
    """
    if not is_cuda(device):
        return [{} for _ in range(n_workers)]
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    if n_gpus is None:
        from .devices import cuda_count

        n_gpus = cuda_count()
    out = []
    for gpu in gpu_assignment(n_workers, device, n_gpus):
        real = ids[int(gpu)] if ids and int(gpu) < len(ids) else gpu
        out.append({"CUDA_VISIBLE_DEVICES": str(real)})
    return out


def local_worker_specs(n_workers: int, device: str, resources: Mapping[str, float] | None = None,
                       n_gpus: int | None = None) -> dict[str, dict[str, Any]]:
    """``distributed.SpecCluster`` worker specs: single-threaded nannies, each with its env and resources."""
    from distributed import Nanny

    specs = {}
    for k, env in enumerate(local_worker_env(n_workers, device, n_gpus)):
        options: dict[str, Any] = {"nthreads": 1, "host": "127.0.0.1", "dashboard_address": None,
                                   "resources": dict(resources or {}), "silence_logs": 40}
        if env:
            options["env"] = env
        specs[f"vsekit-{k}"] = {"cls": Nanny, "options": options}
    return specs


@contextlib.contextmanager
def _local(n: int, device: str, resources, n_gpus: int | None = None) -> Iterator[Any]:
    from distributed import Scheduler, SpecCluster

    if is_cuda(device) and _has_dask_cuda() and ":" not in device and n_gpus is None:
        from dask_cuda import LocalCUDACluster  # one worker per GPU, pinned by dask-cuda itself

        with LocalCUDACluster(n_workers=n, threads_per_worker=1, host="127.0.0.1",
                              dashboard_address=None, resources=dict(resources or {})) as cluster:
            yield cluster
        return
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    with SpecCluster(workers=local_worker_specs(n, device, resources, n_gpus), scheduler=scheduler,
                     silence_logs=40) as cluster:
        yield cluster


def _has_dask_cuda() -> bool:
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return False
    return True


# --- slurm:N ----------------------------------------------------------------------------------------
def slurm_kwargs(settings: Mapping[str, Any], device: str, resources: Mapping[str, float] | None) -> dict:
    """``dask_jobqueue.SLURMCluster`` keyword arguments from vsekit's cluster settings."""
    s = dict(settings)
    gpus = int(s.pop("gpus", 1 if is_cuda(device) else 0) or 0)
    cores = int(s.pop("cores", 1))
    # CPU jobs: one single-threaded worker per core (as local:N); GPU jobs: one worker per job
    processes = int(s.pop("processes", 1 if gpus else cores))
    if gpus > 1:
        raise ValueError(f"cluster setting gpus: {gpus}: a job's workers would all share its first GPU; "
                         f"use gpus: 1 and more jobs (slurm:N with N = the number of GPUs)")
    kw: dict[str, Any] = {"cores": cores, "processes": processes, "memory": s.pop("memory", "4GB"),
                          "job_extra_directives": list(s.pop("job_extra", []) or []),
                          "job_script_prologue": list(s.pop("prologue", []) or []),
                          "silence_logs": "error", "dashboard_address": None}
    extra = [] if cores == processes else ["--nthreads", "1"]  # one task at a time per worker
    res = dict(resources or {})
    if gpus:
        kw["job_extra_directives"].append(f"--gres=gpu:{gpus}")
        res["GPU"] = gpus / processes
    if res:
        extra += ["--resources", ",".join(f"{k}={v:g}" for k, v in res.items())]
    kw["worker_extra_args"] = extra
    for key in ("queue", "account", "walltime", "interface", "python", "log_directory", "local_directory"):
        if key in s:
            kw[key] = s.pop(key)
    if "host" in s:
        kw["scheduler_options"] = {"host": s.pop("host")}
    return kw


@contextlib.contextmanager
def _slurm(n: int, device: str, resources, settings) -> Iterator[Any]:
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError:
        raise ValueError("--cluster slurm:N needs dask-jobqueue: pip install 'vsekit[slurm]'") from None
    import shutil

    kw = slurm_kwargs(cluster_settings(settings), device, resources)
    if shutil.which("sbatch") is None:
        raise ValueError(f"--cluster slurm:{n}: `sbatch` is not on the PATH; run vsekit where SLURM jobs "
                         f"can be submitted (a login node)")
    try:
        cluster = SLURMCluster(**kw)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"--cluster slurm:{n}: cannot start the dask scheduler for SLURM ({exc})") from exc
    with cluster:
        cluster.scale(jobs=n)
        yield cluster


# --- the entry point --------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster_client(spec: str | None, *, resources: Mapping[str, float] | None = None,
                   device: str = "cpu", settings: Mapping[str, Any] | None = None,
                   timeout: float = 30, n_gpus: int | None = None) -> Iterator[Any]:
    """Yield a ``distributed.Client`` for ``spec``, or ``None`` for in-process work.

    ``local:N`` and ``slurm:N`` clusters are started here and shut down afterwards (``resources``
    and, on a CUDA ``device``, ``GPU=1`` are declared by every worker); ``tcp://`` joins an
    existing scheduler. ``n_gpus`` overrides the GPU count for the local assignment (tests).
    """
    parsed = parse_cluster(spec)
    if parsed is None:
        yield None
        return
    from distributed import Client

    kind, arg = parsed
    if kind == "slurm-array":
        raise ValueError(f"--cluster {spec}: job arrays run `vsekit extract` only; use slurm:N here")
    if kind == "tcp":
        try:
            client = Client(arg, timeout=timeout)
        except OSError as exc:
            raise ValueError(f"--cluster {arg}: cannot reach the dask scheduler ({exc})") from exc
        with client:
            yield client
        return
    starter = (_local(arg, device, resources, n_gpus) if kind == "local"
               else _slurm(arg, device, resources, settings))
    with starter as cluster, Client(cluster, timeout=timeout) as client:
        yield client
