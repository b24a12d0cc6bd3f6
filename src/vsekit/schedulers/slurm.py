"""SLURM: ``sbatch`` / ``scancel`` / ``squeue``; ``--cluster slurm:N`` (dask-jobqueue's
``SLURMCluster``) and ``slurm-array:N`` (one ``sbatch --array=0-(N-1)``, tasks numbered from 0 by
``SLURM_ARRAY_TASK_ID``). Tested on a real SLURM (tests/test_slurm.py, tests/test_slurm_array.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping

from .base import Scheduler, clock, job_cores, job_memory


def mem_mb(memory: Any) -> int:
    """``16GB``, ``4000MB``, ``2GiB``, ``8G`` or a number of bytes (dask's ``parse_bytes``) → megabytes
    for ``--mem``."""
    from dask.utils import parse_bytes

    try:
        n = parse_bytes(memory)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError(f"cluster setting memory: {memory!r}: expected e.g. 16GB or 4000MB")
    return max(1, math.ceil(n / 2**20))


class Slurm(Scheduler):
    name, label, cluster = "slurm", "SLURM", "SLURMCluster"
    submit, cancel, status = "sbatch", "scancel", "squeue"
    check = ("--test-only",)
    tested = True
    keys = {"account": "SLURM / PBS account (-A)"}
    alive_states = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                              "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})
    array_flags = ("--parsable",)
    task_env, job_env, cpus_env = "SLURM_ARRAY_TASK_ID", ("SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID"), "SLURM_CPUS_PER_TASK"
    first_task = 0

    def seconds(self, walltime: str) -> int | None:
        return clock(walltime, 60)   # sbatch -t 30: minutes

    def requests(self, kw, s, cores, gpus, memory) -> None:
        kw["job_cpu"] = cores
        if gpus:
            kw["job_extra_directives"].append(f"--gres=gpu:{gpus}")

    def pending_args(self, ids: list[str]) -> list[str]:
        return ["-h", "-j", ",".join(ids), "-o", "%i %T %r"]

    def pending_rows(self, out: str, ids: list[str]) -> list[list[str]]:
        return [ln.split(None, 2) for ln in out.splitlines() if ln.strip()]

    def job_states(self, job_id: str) -> list[str] | None:
        out = self._query(["-h", "-j", str(job_id), "-o", "%T"])
        if out is None:
            return None
        if out.returncode != 0:
            return [] if "invalid job id" in out.stderr.lower() else None
        return [s.strip() for s in out.stdout.split() if s.strip()]

    def array_header(self, name: str, tasks: int, settings: Mapping[str, Any], gpus: int,
                     log_dir: Path) -> tuple[list[str], str]:
        lines = ["#!/bin/bash", f"#SBATCH --job-name=vsekit-{re.sub(r'[^A-Za-z0-9._-]', '_', name)}",
                 f"#SBATCH --array={self.first_task}-{self.first_task + tasks - 1}", "#SBATCH --ntasks=1",
                 f"#SBATCH --cpus-per-task={int(settings.get('cores') or job_cores(gpus))}",
                 f"#SBATCH --mem={mem_mb(settings.get('memory') or job_memory(gpus))}M",
                 f"#SBATCH --output={log_dir}/%x-%A_%a.out"]
        for key, flag in (("queue", "-p"), ("account", "-A"), ("walltime", "-t")):
            if settings.get(key):
                lines.append(f"#SBATCH {flag} {settings[key]}")
        if gpus:
            lines.append(f"#SBATCH --gres=gpu:{gpus}")
        return lines, "#SBATCH"

    def array_job_id(self, stdout: str) -> str:
        return stdout.strip().split(";")[0].split(".")[0]   # --parsable: ID[;CLUSTER]


SCHEDULER = Slurm()
