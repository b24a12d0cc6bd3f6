"""A dask worker preload (``dask worker --preload vsekit.cluster_pin``): pin each worker of a SLURM
job to one of the job's GPUs.

A job with ``gpus: G`` runs G worker processes (``--nworkers G``) named ``<job>-0`` ... ``<job>-(G-1)``
and SLURM shows the job its G GPUs in ``CUDA_VISIBLE_DEVICES``. Before any task (hence before CUDA
is initialised), worker k keeps only the k-th of them, so inside it that GPU is ``cuda``.
"""

from __future__ import annotations

import os


def gpu_for(worker_name: str, visible: str | None) -> str | None:
    """The one GPU id worker ``worker_name`` keeps of ``visible`` (None: leave the environment as is)."""
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not ids:
        return None
    tail = str(worker_name).rsplit("-", 1)[-1]
    k = int(tail) if tail.isdigit() else 0
    return ids[k % len(ids)]


def dask_setup(worker) -> None:
    gpu = gpu_for(worker.name, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
