"""``--cluster local:N``: N single-threaded worker processes on 127.0.0.1. With a CUDA device each
worker is pinned to one GPU (``CUDA_VISIBLE_DEVICES``, round-robin, see
:func:`vsekit.devices.gpu_assignment`) and declares the resource ``GPU=1``, so one task at a time runs
per GPU (dask-cuda's ``LocalCUDACluster`` when it is installed)."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

from ..devices import gpu_assignment, is_cuda

#: dask pauses a worker at 80% of its memory limit, and a paused worker starts no task: a run whose
#: blocks need more than that would hang. vsekit's workers never pause (terminating at 95% stays: a
#: block that really exhausts memory ends its worker, and its rows are bisected).
NO_PAUSE = {"DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False"}


def local_config() -> dict[str, Any]:
    """dask settings of a local cluster. Its nannies restart their own workers, so dask's lost-worker
    reaper (which closes a worker's nanny for good if no worker of its name is up when it looks,
    lost-worker-timeout after a death) could only close one caught mid-restart: off. A run whose
    workers are all gone fails its tasks after no-workers-timeout (the user's, else 120 s) instead of
    waiting forever (docs/gpus_clusters.md, "An image that kills its worker")."""
    import dask

    key = "distributed.scheduler.no-workers-timeout"
    return {"distributed.deploy.lost-worker-timeout": "3650d", key: dask.config.get(key, None) or "120s"}


def local_worker_env(n_workers: int, device: str, n_gpus: int, visible: str | None) -> list[dict[str, str]]:
    """The extra environment of each local worker: its own GPU on a CUDA device, nothing on CPU.

    ``n_gpus``: the GPUs this process sees; ``visible``: its ``CUDA_VISIBLE_DEVICES``. GPU k of the
    assignment is the k-th visible one, so a job already restricted to GPUs "2,3" uses 2 and 3.
    """
    if not is_cuda(device):
        return [{} for _ in range(n_workers)]
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    out = []
    for gpu in gpu_assignment(n_workers, device, n_gpus):
        real = ids[int(gpu)] if ids and int(gpu) < len(ids) else gpu
        out.append({"CUDA_VISIBLE_DEVICES": str(real)})
    return out


def local_worker_specs(n_workers: int, device: str, resources: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """``distributed.SpecCluster`` worker specs: single-threaded nannies, each with its env (its GPU,
    of those this process sees) and resources."""
    from distributed import Nanny

    from ..devices import cuda_count

    n_gpus = cuda_count() if is_cuda(device) else 0
    specs = {}
    for k, env in enumerate(local_worker_env(n_workers, device, n_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))):
        options: dict[str, Any] = {"nthreads": 1, "host": "127.0.0.1", "dashboard_address": None,
                                   "resources": dict(resources or {}), "silence_logs": 40,
                                   "env": {**NO_PAUSE, **env}}
        specs[f"vsekit-{k}"] = {"cls": Nanny, "options": options}
    return specs


@contextlib.contextmanager
def start(n: int, device: str, resources) -> Iterator[Any]:
    import dask
    from distributed import Scheduler, SpecCluster

    if is_cuda(device) and _has_dask_cuda() and ":" not in device:
        from dask_cuda import LocalCUDACluster  # one worker per GPU, pinned by dask-cuda itself

        with dask.config.set({"distributed.worker.memory.pause": False, **local_config()}), LocalCUDACluster(
                n_workers=n, threads_per_worker=1, host="127.0.0.1", dashboard_address=None,
                resources=dict(resources or {})) as cluster:
            yield cluster
        return
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    with dask.config.set(local_config()), SpecCluster(workers=local_worker_specs(n, device, resources),
                                                      scheduler=scheduler, silence_logs=40) as cluster:
        yield cluster


def _has_dask_cuda() -> bool:
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return False
    return True
