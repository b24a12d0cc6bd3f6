"""What the stand-in batch schedulers of the tests share (tests/pbs_local.py, lsf_local.py,
htcondor_local.py): no PBS, LSF or HTCondor server can be installed here, so their submit, cancel
and status commands are small Python programs put first on the PATH.

Each stand-in's commands are functions of its module; :func:`install` writes, for each, a shell
wrapper into ``folder/bin`` that runs the module with the command's name (``python -S -E``: the
standard library only, none of the caller's Python settings). A submitted job is started at once
(:func:`start`) in its own session, with the environment its scheduler gives a job, its output
where its directives say, and its process id in ``folder/jobs/ID.pid``; the status command lists
the jobs whose process lives (:func:`alive`), the cancel command ends a job's whole process group
(:func:`cancel`). What the stand-ins test for real: the job scripts dask-jobqueue writes from
vsekit's settings, how they are submitted, how the job id is read back, and that exactly the run's
jobs are cancelled; not the schedulers' own scheduling (queues, limits, placement).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping


def install(folder: Path, module: str, commands: list[str], dir_var: str) -> dict[str, str]:
    """Write ``commands`` (of the stand-in module file ``module``) into ``folder/bin``; returns the
    environment that puts them first on the PATH and names the jobs' folder (``folder/jobs``) in
    ``dir_var``."""
    bin_dir, jobs = folder / "bin", folder / "jobs"
    bin_dir.mkdir(parents=True, exist_ok=True)
    jobs.mkdir(exist_ok=True)
    for name in commands:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -E {shlex.quote(module)} {name} "$@"\n')
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", dir_var: str(jobs)}


def main(commands: Mapping[str, Callable[[list[str]], int]]) -> None:
    """Run the command named by ``argv[1]`` with the rest of the arguments; exit with its status."""
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))


def jobs_dir(dir_var: str) -> Path:
    return Path(os.environ[dir_var])


def new_id(jobs: Path) -> int:
    """The next job number of this stand-in (1, 2, ...), taken atomically (create-if-absent)."""
    n = 1
    while True:
        try:
            (jobs / f"{n}.id").open("x").close()
            return n
        except FileExistsError:
            n += 1


def start(jobs: Path, job_id: str, argv: list[str], env: Mapping[str, str], stdout: Path | None,
          stderr: Path | None, cwd: Path, executable: str | None = None) -> int:
    """Start ``argv`` as the job ``job_id`` now, in its own session, with exactly ``env``; its
    output appended to ``stdout`` / ``stderr`` (the same file: both there; None: discarded).
    Returns its pid (also in ``jobs/JOB_ID.pid``). The stand-in exits without waiting for it."""
    def sink(path: Path | None):
        if path is None:
            return subprocess.DEVNULL
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("ab")

    out = sink(stdout)
    err = subprocess.STDOUT if stderr is not None and stderr == stdout else sink(stderr)
    proc = subprocess.Popen(argv, executable=executable, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=out, stderr=err, start_new_session=True)
    (jobs / f"{job_id}.pid").write_text(str(proc.pid))
    proc.returncode = 0   # it is the job's now: no "still running" warning when this process exits
    return proc.pid


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")   # a zombie has ended


def alive(jobs: Path) -> list[str]:
    """The ids of the jobs whose process still runs, in submission order."""
    out = []
    for f in jobs.glob("*.pid"):
        if _pid_alive(int(f.read_text())):
            out.append(f.name[: -len(".pid")])
    return sorted(out, key=lambda j: [int(p) if p.isdigit() else p for p in j.split(".")])


def cancel(jobs: Path, job_id: str) -> bool:
    """End the job's whole process group (SIGTERM) and note it (``jobs/JOB_ID.cancelled``: the
    tests see which jobs were cancelled, not ended on their own); False if no such job runs."""
    try:
        pid = int((jobs / f"{job_id}.pid").read_text())
    except (OSError, ValueError):
        return False
    if not _pid_alive(pid):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    (jobs / f"{job_id}.cancelled").touch()
    return True


# --- for the tests ------------------------------------------------------------------------------
def live_jobs(folder: Path) -> list[int]:
    """The pids of jobs still running (none once a run has cancelled its own)."""
    return [int(f.read_text()) for f in (folder / "jobs").glob("*.pid") if _pid_alive(int(f.read_text()))]


def end_all(folder: Path) -> None:
    """Stop every job the stand-in started (a test's clean-up)."""
    for pid in live_jobs(folder):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
