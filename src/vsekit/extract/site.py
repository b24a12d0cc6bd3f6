"""An :class:`~.job.Execution` resolved where its task runs, once, by :func:`resolve`: the device
(``auto`` → ``cuda`` where this process sees a GPU), the decoding workers (``auto`` sized to the
site's cores, at least :data:`MIN_DECODERS` on a cluster), whether they are processes, threads
(inside a daemonic dask worker) or the task's own thread, and the prefetch. A value that cannot
apply as asked on the site comes back as a note (``Resolved.notes``), which the executors print once
and record in the set's ``execution_notes``. docs/gpus_clusters.md, "Sized for a GPU".
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass

from .job import Execution, Site
from .throughput import decode_workers

#: decoding workers of a task on a cluster site, at least: decoding overlaps the model
MIN_DECODERS = 2


@dataclass(frozen=True)
class Resolved:
    """An Execution as it applies on one site: ``run`` with a concrete device, a number of decoding
    workers and the prefetch; ``decoding``: processes | threads | in-thread; ``notes``: what could
    not apply as asked, and what was done instead."""

    run: Execution
    decoding: str
    notes: tuple[str, ...] = ()


def own_cpus() -> int:
    """The CPU cores this process may run on (its affinity: a SLURM job's, a container's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve(run: Execution, site: Site) -> Resolved:
    """``run`` resolved on ``site`` (see module doc); call it where the task runs."""
    from ..devices import resolve_device

    device = resolve_device(run.device)
    cpus = site.cpus or own_cpus()
    requested = run.workers
    notes: list[str] = []
    if requested is None or str(requested).strip().lower() == "auto":
        n = cpus if site.kind == "dask" else decode_workers("auto", device, cpus=cpus)
        if site.kind != "in-process":
            n = max(MIN_DECODERS, n)
    else:
        n = decode_workers(requested, device)
    daemon = multiprocessing.current_process().daemon
    decoding = "in-thread" if n == 0 else ("threads" if daemon else "processes")
    if decoding == "threads" and str(requested).strip().lower() != "auto":
        notes.append(f"--workers {requested}: {n} decoding threads, not processes, in each dask task "
                     f"(a dask worker is a daemon process and cannot start processes)")
    if str(run.pin_memory).strip().lower() == "on" and not device.startswith("cuda"):
        notes.append(f"--pin-memory on: the tasks run on {device}, where there is nothing to pin; "
                     f"batches are not pinned")
    prefetch = int(run.prefetch)
    if prefetch < 1:
        raise ValueError(f"--prefetch must be >= 1, got {run.prefetch}")
    return Resolved(run.replace(device=device, workers=n, prefetch=prefetch), decoding, tuple(notes))
