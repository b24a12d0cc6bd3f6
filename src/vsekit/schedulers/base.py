"""The one interface every batch scheduler module fills in (:mod:`vsekit.schedulers`): what all
schedulers share is written here once, and a module overrides only what differs."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

CHECK_TIMEOUT_S = 60
QUERY_TIMEOUT_S = 30

#: a GPU job's host resources by default: decoding 10-crop images for one GPU takes ~6 cores
#: (docs/gpus_clusters.md), and its batches, pinned buffers and decoders need memory beyond 4 GB
CORES_PER_GPU, MEMORY_PER_GPU_GB, MEMORY_DEFAULT = 6, 16, "4GB"


def job_cores(gpus: int) -> int:
    """Default ``cores`` of a job (or array task) with ``gpus`` GPUs: 6 per GPU, else 1."""
    return CORES_PER_GPU * gpus if gpus else 1


def job_memory(gpus: int) -> str:
    """Default ``memory`` of a job (or array task) with ``gpus`` GPUs: 16 GB per GPU, else 4 GB."""
    return f"{MEMORY_PER_GPU_GB * gpus}GB" if gpus else MEMORY_DEFAULT


def clock(text: str, bare: int) -> int | None:
    """``[D-]HH:MM:SS`` / ``MM:SS`` as seconds (or, with ``bare``, a plain number times ``bare``)."""
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        if not d.isdigit():
            return None
        days = int(d)
    parts = text.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (len(parts) == 1 and not bare):
        return None
    nums = [int(p) for p in parts]
    scale = {1: [bare], 2: [60, 1], 3: [3600, 60, 1]}[len(nums)]
    return days * 86400 + sum(n * s for n, s in zip(nums, scale))


def last_error(text: str) -> str:
    """The line of a scheduler's output that says what went wrong (its last error, else its last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip() != "Exiting."]
    errors = [ln for ln in lines if "error" in ln.lower() or "unable" in ln.lower()]
    return (errors or lines or ["(no message)"])[-1]


class Scheduler:
    """One batch scheduler: ``name`` (``--cluster NAME:N``, and the name locks and leases record),
    ``label`` (for messages), ``cluster`` (the dask-jobqueue class), its commands, ``check`` (the
    ``submit`` arguments that verify a job script without running it; None: no early refusal),
    ``tested`` (on the real scheduler here), ``keys`` (the settings only it takes, with what they
    mean), ``walltime`` (whether its jobs take one). Job arrays, where ``array_flags`` (``submit``
    prints the job id only) is not None: the environment a task finds its number, job and cores in,
    and the number of the first task."""

    name = label = cluster = submit = cancel = status = ""
    check: tuple[str, ...] | None = None
    tested = False
    keys: dict[str, str] = {}
    walltime = True
    alive_states = frozenset({"RUNNING"})
    array_flags: tuple[str, ...] | None = None
    task_env: str | None = None
    job_env: tuple[str, ...] = ()
    cpus_env: str | None = None
    first_task = 0

    def seconds(self, walltime: str) -> int | None:
        """``walltime`` in this scheduler's syntax as seconds; None if it cannot be read."""
        return None if "-" in walltime else clock(walltime, 1)

    def requests(self, kw: dict[str, Any], s: dict[str, Any], cores: int, gpus: int, memory: str) -> None:
        """Write into dask-jobqueue's keyword arguments ``kw`` what only this scheduler asks for a job
        of ``cores``, ``gpus`` and ``memory`` (its own settings popped from ``s``)."""

    def tool(self, command: str | None = None, what: str | None = None) -> str:
        """The path of ``command`` (default: ``submit``), or one ValueError that says where to run."""
        command = command or self.submit
        path = shutil.which(command)
        if path is None:
            raise ValueError(f"--cluster {what or self.name + ':N'}: `{command}` is not on the PATH; run "
                             f"vsekit where {self.label} jobs can be submitted (a login node)")
        return path

    def check_submission(self, job_script: str, n: int) -> None:
        """Verify ``job_script`` without running it (``check``): a queue, account, resource or size the
        scheduler refuses is one ValueError with its own message, before anything is submitted."""
        if self.check is None:
            return
        with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
            f.write(job_script)
        what = f"`{self.submit} {' '.join(self.check)}`"
        try:
            out = subprocess.run([self.tool(), *self.check, f.name], capture_output=True, text=True,
                                 timeout=CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ValueError(f"--cluster {self.name}:{n}: {what} did not answer in {CHECK_TIMEOUT_S} s") from None
        finally:
            os.unlink(f.name)
        if out.returncode != 0:
            raise ValueError(f"--cluster {self.name}:{n}: {self.label} refuses the job: "
                             f"{last_error(out.stderr + out.stdout)}")

    def cancel_jobs(self, ids: list[str]) -> None:
        """Cancel exactly these jobs (a run's own), quietly: some may have ended."""
        if ids:
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                subprocess.run([self.tool(self.cancel), *ids], capture_output=True, timeout=QUERY_TIMEOUT_S)

    def cancel_hint(self, job: str | None) -> str:
        """The command that cancels ``job``, for messages (``scancel 48``)."""
        return f"{self.cancel} {job}"

    #: ``status``'s flag before a job id in messages (``squeue -j 48``; ``bjobs 48``)
    queue_flag = "-j "

    def queue_hint(self, job: str | None) -> str:
        """The command that shows ``job`` in the queue, for messages (``squeue -j 48``)."""
        return f"{self.status} {self.queue_flag}{job}"

    def pending_args(self, ids: list[str]) -> list[str]:
        """``status``'s arguments that list ``ids`` with their state."""
        return []

    #: the column of ``status``'s output with a job's state (qstat: id, priority, name, user, state)
    state_column = 4

    def pending_rows(self, out: str, ids: list[str]) -> list[list[str]]:
        """``[job, state, reason]`` of each job of ``ids`` in ``status``'s output ``out``."""
        col = self.state_column
        return [[r[0], r[col], self.status] for r in (ln.split() for ln in out.splitlines())
                if len(r) > col and r[0].split(".")[0] in ids]

    def pending_reasons(self, ids: list[str]) -> str:
        """The state of each job of ``ids`` as the scheduler says it, e.g. ``job 12 PENDING (Resources)``."""
        if not ids:
            return "no job was submitted"
        try:
            out = subprocess.run([self.tool(self.status), *self.pending_args(ids)], capture_output=True,
                                 text=True, timeout=QUERY_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{self.status} failed ({exc})"
        rows = self.pending_rows(out.stdout, ids)
        if not rows:
            return f"jobs {', '.join(ids)} are no longer queued" + (f" ({last_error(out.stderr)})" if out.stderr else "")
        return "; ".join(f"job {r[0]} {r[1] if len(r) > 1 else '?'} ({r[2] if len(r) > 2 else '?'})" for r in rows)

    def job_states(self, job_id: str) -> list[str] | None:
        """The states of job ``job_id``'s tasks ([] once it has left the queue); None when the
        scheduler cannot answer here (not installed, unreachable, or not asked by vsekit)."""
        return None

    def job_alive(self, job_id: str | None) -> bool | None:
        """True while the scheduler lists job ``job_id`` as queued or running; None if it cannot tell."""
        if not job_id:
            return False
        states = self.job_states(str(job_id))
        if states is None:
            return None
        return any(s.upper() in self.alive_states for s in states)

    def _query(self, args: list[str]) -> subprocess.CompletedProcess | None:
        """``status`` with ``args``; None when it is not here or does not answer."""
        exe = shutil.which(self.status)
        if exe is None:
            return None
        try:
            return subprocess.run([exe, *args], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None

    def array_header(self, name: str, tasks: int, settings: Mapping[str, Any], gpus: int,
                     log_dir: Path) -> tuple[list[str], str]:
        """The first lines of an array job script of ``tasks`` tasks and its directive prefix."""
        raise ValueError(f"--cluster {self.name}-array:N: vsekit runs no job arrays on {self.label}")

    def array_job_id(self, stdout: str) -> str:
        """The job id in what ``submit`` with ``array_flags`` printed."""
        return stdout.strip().split(".")[0]

    def task_number(self, env: Mapping[str, str] = os.environ) -> int | None:
        """This array task's number as the scheduler gives it (None outside an array task)."""
        value = env.get(self.task_env or "", "")
        return int(value) if value.isdigit() else None

    def this_job(self, env: Mapping[str, str] = os.environ) -> str | None:
        """The job this process runs in (None outside one of this scheduler's jobs)."""
        return next((env[k] for k in self.job_env if env.get(k)), None)

    def task_cpus(self, env: Mapping[str, str] = os.environ) -> int:
        """The cores this array task was given (1 when the environment does not say)."""
        value = env.get(self.cpus_env or "", "")
        return int(value) if value.isdigit() else 1
