"""Grid Engine: ``qsub`` / ``qdel`` / ``qstat``; ``--cluster sge:N`` (dask-jobqueue's ``SGECluster``)
and ``sge-array:N`` (one ``qsub -t 1-N``, tasks numbered from 1 by ``SGE_TASK_ID``). Tested on a real
Grid Engine (tests/test_sge.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from .base import Scheduler, job_cores, job_memory


def sge_memory(memory: str) -> str:
    """dask's ``16GB`` as Grid Engine writes memory (``15259M``: K, M, G are powers of 1024 there)."""
    from dask.utils import parse_bytes

    return f"{max(1, -(-parse_bytes(memory) // 2**20))}M"


def _requests(s: Mapping[str, Any], memory: str, gpus: int, cores: int) -> tuple[str, str | None]:
    """The ``-l`` resources of a job (memory only where ``memory_resource`` names the site's resource,
    GPUs as ``gpu_resource``, default ``gpu``) and its ``-pe PE cores`` (None for one core)."""
    requests = [f"{s['memory_resource']}={sge_memory(memory)}"] if s.get("memory_resource") else []
    if gpus:
        requests.append(f"{s.get('gpu_resource') or 'gpu'}={gpus}")
    if cores > 1 and not s.get("pe"):
        raise ValueError(f"cluster settings cores: {cores} on Grid Engine need pe: the name of the site's "
                         f"parallel environment for one host (`qconf -spl` lists them)")
    return ",".join(requests), (f"{s['pe']} {cores}" if cores > 1 else None)


class GridEngine(Scheduler):
    name, label, cluster = "sge", "Grid Engine", "SGECluster"
    submit, cancel, status = "qsub", "qdel", "qstat"
    check = ("-w", "v")
    tested = True
    keys = {"project": "Grid Engine / LSF project (-P)",
            "pe": "Grid Engine parallel environment for jobs of more than one core (-pe PE cores)",
            "memory_resource": "Grid Engine resource that requests memory per job (default: none; e.g. h_vmem)",
            "gpu_resource": "Grid Engine resource that requests GPUs (default gpu: -l gpu=G)"}
    array_flags = ("-terse", "-w", "e")
    task_env, job_env, cpus_env = "SGE_TASK_ID", ("JOB_ID",), "NSLOTS"   # NSLOTS: the task's slots
    first_task = 1

    def requests(self, kw, s, cores, gpus, memory) -> None:
        """``-l MEMORY_RESOURCE=...`` only if ``memory_resource`` names the site's resource (Grid Engine
        has no standard one, and a load value such as ``mem_free`` fails ``qsub -w v``), ``-l
        GPU_RESOURCE=G`` (default ``gpu``), ``-pe PE cores`` for more than one core, and ``-V`` (the
        job sees the submitting environment, as with sbatch)."""
        requests, pe = _requests(s, memory, gpus, cores)
        for key in ("pe", "memory_resource", "gpu_resource"):
            s.pop(key, None)
        if requests:
            kw["resource_spec"] = requests
        if pe:
            kw["job_extra_directives"].append(f"-pe {pe}")
        kw["job_extra_directives"].append("-V")

    def job_states(self, job_id: str) -> list[str] | None:
        """``qstat -j`` knows the job (``["RUNNING"]``: queued or running) or not ([])."""
        out = self._query(["-j", str(job_id)])
        if out is None:
            return None
        if out.returncode == 0:
            return ["RUNNING"]
        return [] if "do not exist" in (out.stderr + out.stdout).lower() else None

    def array_header(self, name: str, tasks: int, settings: Mapping[str, Any], gpus: int,
                     log_dir: Path) -> tuple[list[str], str]:
        """``-t 1-N`` with the queue, h_rt, memory and GPU resources and the parallel environment,
        written as ``sge:N`` writes its jobs."""
        cores = int(settings.get("cores") or job_cores(gpus))
        lines = ["#!/bin/bash", f"#$ -N vsekit-{re.sub(r'[^A-Za-z0-9._-]', '_', name)}",
                 f"#$ -t {self.first_task}-{self.first_task + tasks - 1}", "#$ -S /bin/bash", "#$ -V", "#$ -j y",
                 f"#$ -o {log_dir}/"]
        for key, flag in (("queue", "-q "), ("project", "-P "), ("walltime", "-l h_rt=")):
            if settings.get(key):
                lines.append(f"#$ {flag}{settings[key]}")
        requests, pe = _requests(settings, settings.get("memory") or job_memory(gpus), gpus, cores)
        if requests:
            lines.append(f"#$ -l {requests}")
        if pe:
            lines.append(f"#$ -pe {pe}")
        return lines, "#$"   # qsub -terse prints an array's id as ID.1-N:1 (the base class's reading)


SCHEDULER = GridEngine()
