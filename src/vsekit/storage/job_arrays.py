"""What a SLURM job array writing a feature set leaves in the store, and how to read it back.

``vsekit extract ... --cluster slurm-array:N`` (:mod:`vsekit.extract.array`) keeps, per feature set,
``STORE/.vsekit/arrays/NAME/``:

- ``spec.json``: what every array task needs (the plan, device, batch size, the lease time-to-live,
  the set's settings hash, the token of the set's writer lock) and the array's SLURM job id;
- ``leases/``: one lease file per block being written (:mod:`vsekit.storage.leases`);
- ``errors/``: the failure reasons of each committed block's failed rows, merged into the set's
  attrs by whichever task finishes (attrs have one writer at a time);
- ``job-*.sh``: the submitted job scripts; ``logs/``: the tasks' output unless ``log_directory``
  says otherwise.

While the array runs it holds the set's writer lock (:mod:`vsekit.storage.lock`): the lock file
names the array's job id, and it is stale once ``squeue`` no longer lists that job.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from .leases import LeaseDir

ARRAY_DIR = (".vsekit", "arrays")
ALIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}


def array_dir(store_path: str | os.PathLike, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return Path(store_path).joinpath(*ARRAY_DIR) / safe


def lease_dir(store_path: str | os.PathLike, name: str, ttl: float | None = None,
              owner: dict | None = None) -> LeaseDir:
    return LeaseDir(array_dir(store_path, name) / "leases", ttl=ttl, owner=owner)


def read_spec(store_path: str | os.PathLike, name: str) -> dict | None:
    try:
        return json.loads((array_dir(store_path, name) / "spec.json").read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` whole or not at all (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


def remove(store_path: str | os.PathLike, name: str) -> None:
    shutil.rmtree(array_dir(store_path, name), ignore_errors=True)


LABELS = {"slurm": "SLURM", "sge": "Grid Engine"}


# --- the scheduler's view --------------------------------------------------------------------------------
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


def lock_stale_reason(path: Path, info: dict, limit: float) -> str | None:
    """Staleness of a writer lock held by a job array: its job has left ``squeue``; where squeue
    cannot tell, the lock's age beyond ``limit`` seconds (the tasks refresh it)."""
    job = info.get("array_job") or info.get("slurm_array")
    scheduler = info.get("array_scheduler", "slurm")
    alive = job_alive(job, scheduler)
    if alive is True:
        return None
    if alive is False:
        return f"{LABELS.get(scheduler, scheduler)} array job {job} has ended"
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "released"
    return f"not refreshed for {age:.0f}s" if age > limit else None


# --- progress ------------------------------------------------------------------------------------
def progress_lines(fs, indent: str = "      ") -> list[str]:
    """``vsekit info`` lines of the job array writing (or that wrote) ``fs``; [] if none did."""
    spec = read_spec(fs.store.path, fs.name)
    if spec is None:
        return []
    job = spec.get("job_id")
    scheduler = spec.get("scheduler", "slurm")
    alive = job_alive(job, scheduler)
    ask = "qstat" if scheduler == "sge" else "squeue"
    state = {True: "queued or running", False: "ended", None: f"state unknown ({ask} could not answer here)"}[alive]
    lines = [f"{indent}{LABELS.get(scheduler, scheduler)} job array {job or '?'} ({spec.get('tasks', '?')} tasks): {state}"]
    try:
        status = fs.status_values()
    except Exception as exc:
        return lines + [f"{indent}  blocks: unreadable status ({exc})"]
    blocks = fs.blocks()
    done = sum(1 for b in blocks if np.all(status[b.start:b.stop] != 0))
    failed = sum(1 for b in blocks if np.any(status[b.start:b.stop] == 2))
    lines.append(f"{indent}  blocks: {done} done, {len(blocks) - done} pending of {len(blocks)}"
                 f" ({failed} with failed rows)")
    live, expired = [], []
    for s in lease_dir(fs.store.path, fs.name).states():
        (expired if s.expired else live).append(s)
    lines.append(f"{indent}  leases: {len(live)} live, {len(expired)} expired")
    now = time.time()
    for s in (live + expired)[:20]:
        o = s.owner
        who = f"job {o.get('job')} task {o.get('task')} on {o.get('host')} pid {o.get('pid')}"
        when = (f"expires in {s.expires - now:.0f}s" if not s.expired
                else f"expired {now - s.expires:.0f}s ago (another task may take it over)")
        lines.append(f"{indent}    block {s.key}: {who}, {when}")
    pending_errors = len(list((array_dir(fs.store.path, fs.name) / "errors").glob("b*.json")))
    if pending_errors:
        lines.append(f"{indent}  {pending_errors} block(s) of failure reasons not yet merged into the set")
    if alive is False and done < len(blocks):
        lines.append(f"{indent}  the array has ended with blocks left: rerun the same extract command "
                     f"to fill them")
    return lines
