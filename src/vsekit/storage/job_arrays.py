"""What a job array writing a feature set leaves in the store, and how to read it back.

``vsekit extract ... --cluster slurm-array:N`` / ``sge-array:N`` (:mod:`vsekit.extract.array`) keeps, per feature set,
``STORE/.vsekit/arrays/NAME/``:

- ``spec.json``: what every array task needs (the plan, device, batch size, the lease time-to-live,
  the set's settings hash, the token of the set's writer lock) and the array's job id and scheduler;
- ``leases/``: one lease file per block being written (:mod:`vsekit.storage.leases`);
- ``errors/``: the failure reasons of each committed block's failed rows, merged into the set's
  attrs by whichever task finishes (attrs have one writer at a time);
- ``job-*.sh``: the submitted job scripts; ``logs/``: the tasks' output unless ``log_directory``
  says otherwise.

While the array runs it holds the set's writer lock (:mod:`vsekit.storage.lock`): the lock file
names the array's job id, and it is taken over by the one rule of every guard
(:func:`vsekit.storage.leases.free_reason`): once the scheduler no longer lists that job and the
lock has expired.

On object storage the same things are objects under ``.vsekit/arrays/NAME/`` in the store (the spec,
``leases/bNNNNNN.json`` of :mod:`vsekit.storage.objleases`, ``errors/``, ``merge/``), the set's lease
object (:class:`vsekit.storage.objstore.SetLease`) is handed to the array, and the job scripts and
logs stay in a local folder (:func:`local_dir`). :func:`place` gives either kind of store through
one interface (:class:`ArrayState`), so the tasks' code is the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..schedulers import get as scheduler
from .leases import LeaseDir
from .objleases import ObjectLeaseDir

ARRAY_DIR = (".vsekit", "arrays")

def array_dir(store_path: str | os.PathLike, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return Path(store_path).joinpath(*ARRAY_DIR) / safe


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` whole or not at all (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


# --- where an array keeps its state: a folder, or objects -----------------------------------------
class _Files:
    """An array's state as files of a folder (each written whole: temporary file, rename)."""

    def __init__(self, root: Path):
        self.root = root

    def read(self, rel: str) -> dict | None:
        try:
            return json.loads((self.root / rel).read_text())
        except (OSError, ValueError):
            return None

    def write(self, rel: str, value: Any) -> None:
        write_json(self.root / rel, value)

    def list(self, rel: str) -> list[str]:
        """The names (relative to the state's root) of the ``b*.json`` files under ``rel``."""
        return sorted(f"{rel}/{p.name}" for p in (self.root / rel).glob("b*.json"))

    def drop(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

    def clear(self, rel: str = "") -> None:
        shutil.rmtree(self.root / rel, ignore_errors=True)

    def leases(self, rel: str, ttl: float | None, owner: dict | None):
        return LeaseDir(self.root / rel, ttl=ttl, owner=owner)


class _Objects:
    """An array's state as objects under a prefix of the store (one put each)."""

    def __init__(self, objects, prefix: str):
        self.objects, self.prefix = objects, prefix

    def read(self, rel: str) -> dict | None:
        got = self.objects.get_json(f"{self.prefix}/{rel}")
        return None if got is None else got[0]

    def write(self, rel: str, value: Any) -> None:
        self.objects.put(f"{self.prefix}/{rel}", json.dumps(value, indent=1, default=str).encode())

    def list(self, rel: str) -> list[str]:
        return [k[len(self.prefix) + 1:] for k in self.objects.keys(f"{self.prefix}/{rel}/")]

    def drop(self, rel: str) -> None:
        self.objects.delete(f"{self.prefix}/{rel}")

    def clear(self, rel: str = "") -> None:
        for key in self.objects.keys(f"{self.prefix}/{rel}".rstrip("/") + "/"):
            self.objects.delete(key)

    def leases(self, rel: str, ttl: float | None, owner: dict | None):
        return ObjectLeaseDir(self.objects, f"{self.prefix}/{rel}", ttl=ttl, owner=owner)


class ArrayState:
    """An array's state under ``.vsekit/arrays/NAME/`` of its store, through one interface whatever the
    store: files on a POSIX disk, objects on object storage. Its leases are the one lease's block
    leases over that store's backend (:func:`.leases.LeaseDir`, :func:`.objleases.ObjectLeaseDir`);
    a handle is a name relative to the state's root."""

    def __init__(self, store, name: str):
        objects = getattr(store, "objects", None)
        # the job scripts and task logs: in the store's folder on a disk, in a local folder otherwise
        self.at, self.scripts = ((_Files(array_dir(store.path, name)), array_dir(store.path, name)) if objects is None
                                 else (_Objects(objects, "/".join([*ARRAY_DIR, re.sub(r"[^A-Za-z0-9._-]", "_", name)])),
                                       local_dir(name)))

    def read_spec(self) -> dict | None:
        return self.at.read("spec.json")

    def write_spec(self, spec: dict) -> None:
        self.at.write("spec.json", spec)

    def drop_spec(self) -> None:
        self.at.drop("spec.json")

    def remove(self) -> None:
        self.at.clear()

    def clear_leases(self) -> None:
        self.at.clear("leases")

    def leases(self, ttl: float | None = None, owner: dict | None = None, rel: str = "leases"):
        return self.at.leases(rel, ttl, owner)

    def merge_leases(self):
        return self.leases(ttl=120, rel="merge")

    def write_errors(self, index: int, errors: dict) -> None:
        self.at.write(f"errors/b{int(index):06d}.json", errors)

    def error_files(self) -> list[tuple[str, dict]]:
        """(handle, reasons) of each block's failure-reasons file not yet merged."""
        return [(h, self.at.read(h) or {}) for h in self.at.list("errors")]

    def drop_errors(self, handles) -> None:
        for h in handles:
            self.at.drop(h)

    def count_errors(self) -> int:
        return len(self.at.list("errors"))


place = ArrayState   # where the array writing NAME of a store keeps its state: ``place(store, NAME)``


def local_dir(name: str) -> Path:
    """Job scripts and task logs of an array on object storage (no store folder to hold them):
    ``vsekit-arrays/NAME`` under the directory the command runs in (an absolute path: the folder
    ``sbatch`` also makes the tasks' working directory; on a cluster, a shared home or project folder
    that the nodes reach, as they must reach ``log_directory``, which chooses another)."""
    return Path.cwd() / "vsekit-arrays" / re.sub(r"[^A-Za-z0-9._-]", "_", name)


# --- progress ------------------------------------------------------------------------------------
def progress_lines(fs, indent: str = "      ") -> list[str]:
    """``vsekit info`` lines of the job array writing (or that wrote) ``fs``; [] if none did."""
    where = place(fs.store, fs.name)
    spec = where.read_spec()
    if spec is None:
        return []
    job = spec.get("job_id")
    sched = scheduler(spec.get("scheduler"))
    alive = sched.job_alive(job)
    state = {True: "queued or running", False: "ended", None: f"state unknown ({sched.status} could not answer here)"}[alive]
    lines = [f"{indent}{sched.label} job array {job or '?'} ({spec.get('tasks', '?')} tasks): {state}"]
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
    for s in where.leases().states():
        (expired if s.expired else live).append(s)
    lines.append(f"{indent}  leases: {len(live)} live, {len(expired)} expired")
    now = time.time()
    for s in (live + expired)[:20]:
        o = s.owner
        who = f"job {o.get('job')} task {o.get('task')} on {o.get('host')} pid {o.get('pid')}"
        when = (f"expires in {s.expires - now:.0f}s" if not s.expired
                else f"expired {now - s.expires:.0f}s ago (another task may take it over)")
        lines.append(f"{indent}    block {s.key}: {who}, {when}")
    pending_errors = where.count_errors()
    if pending_errors:
        lines.append(f"{indent}  {pending_errors} block(s) of failure reasons not yet merged into the set")
    if alive is False and done < len(blocks):
        lines.append(f"{indent}  the array has ended with blocks left: rerun the same extract command "
                     f"to fill them")
    return lines
