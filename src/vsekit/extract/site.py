"""An :class:`~.job.Execution` resolved where its task runs: once, by :func:`resolve`.

Every executor hands its tasks the whole ``Execution`` the user asked for (in-process: as is; dask:
with the device as its pinned workers see it; a job array: serialised whole in the tasks' spec)
and a :class:`Site` that says what the task's place is. The task resolves it there, in one call:

- the device (``auto`` → ``cuda`` where this process sees a GPU, else ``cpu``);
- the decoding workers: a number is taken as given; ``auto`` is sized to this site (in-process:
  :func:`~.throughput.decode_workers` over this process's cores; a dask worker: its share of the
  cores; an array task: ``decode_workers`` over its ``--cpus-per-task``), and on a cluster site at
  least :data:`MIN_DECODERS` so that decoding overlaps the model;
- how they decode: processes, or threads inside a dask worker (a daemon process cannot have
  children), or in the task's own thread (0);
- the prefetch depth (checked, never dropped).

A requested value that cannot apply as asked on the site comes back as a note (``Resolved.notes``):
the executors print it once and record it in the set's attrs (``execution_notes``), so nothing is
ignored or replaced silently (``tests/test_engine_parallel.py``).
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
