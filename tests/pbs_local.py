"""A stand-in PBS for tests: ``qsub``, ``qdel`` and ``qstat`` as small shell scripts on the PATH.

No PBS server can be installed here, so ``--cluster pbs:N`` is driven through dask-jobqueue's own
``PBSCluster`` against these: ``qsub SCRIPT`` copies the job script into the folder, starts it at
once in its own session (as a job on a node: a fresh, minimal environment, no variable of the
submitting shell, as PBS without ``-V``), and prints a job id as PBS does (``1234.pbs-local``);
``qdel ID...`` ends each job's whole process group; ``qstat`` lists the live jobs. What this tests
for real: vsekit's PBS settings, the job script dask-jobqueue writes from them (bash runs it: the
``#PBS`` lines are comments to it), the submission and the cancellation of exactly the run's jobs;
not PBS's own scheduling.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

QSUB = """#!/bin/bash
# qsub SCRIPT: start the job now, in its own session, with a node's minimal environment
set -e
dir="${PBS_LOCAL_DIR:?}"
script="${@: -1}"
id=$$
cp "$script" "$dir/$id.sh"
setsid env -i PATH=/usr/bin:/bin HOME="$HOME" PBS_JOBID="$id.pbs-local" bash "$dir/$id.sh" \\
    > "$dir/$id.out" 2> "$dir/$id.err" < /dev/null &
echo $! > "$dir/$id.pid"
echo "$id.pbs-local"
"""

QDEL = """#!/bin/bash
# qdel ID...: end each job's process group (an ended job is no error, as PBS's qdel -W force)
dir="${PBS_LOCAL_DIR:?}"
for job in "$@"; do
    id="${job%%.*}"
    pid=$(cat "$dir/$id.pid" 2>/dev/null) || continue
    kill -TERM -- "-$pid" 2>/dev/null || true
done
exit 0
"""

QSTAT = """#!/bin/bash
# qstat: one line per live job (id, priority, name, user, state), as vsekit reads PBS's
dir="${PBS_LOCAL_DIR:?}"
for f in "$dir"/*.pid; do
    [ -e "$f" ] || continue
    pid=$(cat "$f"); id=$(basename "$f" .pid)
    kill -0 "$pid" 2>/dev/null && echo "$id.pbs-local 0 dask-worker $USER R"
done
exit 0
"""


def install(folder: Path) -> dict[str, str]:
    """Write the three commands into ``folder/bin``; returns the environment that puts them first on
    the PATH (the jobs' files go to ``folder/jobs``)."""
    bin_dir, jobs = folder / "bin", folder / "jobs"
    bin_dir.mkdir(parents=True, exist_ok=True)
    jobs.mkdir(exist_ok=True)
    for name, text in (("qsub", QSUB), ("qdel", QDEL), ("qstat", QSTAT)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PBS_LOCAL_DIR": str(jobs)}


def live_jobs(folder: Path) -> list[int]:
    """The pids of jobs still running (none once a run has cancelled its own)."""
    out = []
    for f in (folder / "jobs").glob("*.pid"):
        pid = int(f.read_text())
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):   # a zombie has ended
            out.append(pid)
    return out


def end_all(folder: Path) -> None:
    """Stop every job the stand-in started (a test's clean-up)."""
    for pid in live_jobs(folder):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
