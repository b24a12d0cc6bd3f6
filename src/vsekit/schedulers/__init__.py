"""The batch schedulers vsekit drives: one module each (``slurm``, ``sge``, ``pbs``, ``lsf``,
``htcondor``), each a :class:`~vsekit.schedulers.base.Scheduler` that says everything vsekit knows
about it: words for messages, dask-jobqueue class and requests, walltime syntax, early check, job
states (for a job array's lock and lease), job arrays and how their tasks are numbered. Adding a
scheduler is one module here, named in :data:`SCHEDULERS`, plus its tests.

Storage asks ``get(recorded_name).job_alive(job)`` without naming a scheduler itself; the clusters
(:mod:`vsekit.clusters`) and job arrays (:mod:`vsekit.extract.array`) ask the same objects.
"""

from __future__ import annotations

import os
from typing import Mapping

from . import htcondor, lsf, pbs, sge, slurm
from .base import Scheduler

#: every scheduler by name, in the order messages list them
SCHEDULERS: dict[str, Scheduler] = {m.SCHEDULER.name: m.SCHEDULER for m in (slurm, sge, pbs, lsf, htcondor)}


#: the scheduler of the records (locks, leases, specs) written before they named theirs
RECORDS_DEFAULT = "slurm"


def get(name: str | None) -> Scheduler:
    """The scheduler ``name`` (None: :data:`RECORDS_DEFAULT`); a ValueError listing the valid names
    for any other."""
    try:
        return SCHEDULERS[RECORDS_DEFAULT if name is None else str(name)]
    except KeyError:
        raise ValueError(f"unknown batch scheduler {name!r}; valid: {', '.join(SCHEDULERS)}") from None


def this_task(env: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """The job and array task this process runs as, numbered as its scheduler numbers them
    ((None, None) outside a batch job), for the records of the leases it takes."""
    for sched in SCHEDULERS.values():
        job = sched.this_job(env)
        if job is not None:
            task = sched.task_number(env)
            return job, None if task is None else str(task)
    return None, None


__all__ = ["SCHEDULERS", "Scheduler", "get", "this_task"]
