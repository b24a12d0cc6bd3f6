"""What a batch scheduler says of a job (SLURM's ``squeue``, Grid Engine's ``qstat``), for the
staleness of a job array's writer lock (:mod:`.lock`) and of its set lease on object storage
(:func:`.objstore.holder_live`). A leaf: it imports nothing of vsekit's, so both can use it.
"""

from __future__ import annotations

import shutil
import subprocess

ALIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}
LABELS = {"slurm": "SLURM", "sge": "Grid Engine"}
#: a writer lock (or a job array's set lease whose scheduler cannot answer) is stale this long after
#: its last refresh (its expiry)
STALE_ENV = "VSEKIT_LOCK_STALE_S"
DEFAULT_STALE_S = 3600.0


def job_states(job_id: str, scheduler: str = "slurm") -> list[str] | None:
    """The states of job ``job_id``'s tasks that ``squeue`` lists ([] once it has left the queue);
    None when squeue cannot answer (not installed here, or the controller is unreachable). Grid
    Engine (``scheduler="sge"``): ``qstat -j`` knows the job (``["RUNNING"]``: queued or running) or not."""
    if scheduler == "sge":
        return _sge_states(job_id)
    exe = shutil.which("squeue")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return [] if "invalid job id" in out.stderr.lower() else None
    return [s.strip() for s in out.stdout.split() if s.strip()]


def _sge_states(job_id: str) -> list[str] | None:
    exe = shutil.which("qstat")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-j", str(job_id)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode == 0:
        return ["RUNNING"]
    return [] if "do not exist" in (out.stderr + out.stdout).lower() else None


def job_alive(job_id: str | None, scheduler: str = "slurm") -> bool | None:
    """True while the scheduler still lists job ``job_id`` as queued or running; None if it cannot tell."""
    if not job_id:
        return False
    states = job_states(job_id, scheduler)
    if states is None:
        return None
    return any(s.upper() in ALIVE_STATES for s in states)
