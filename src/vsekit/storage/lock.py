"""One writer per feature set: a lock file created with ``O_CREAT | O_EXCL``.

Every stage that writes (extract, standardize, discretize, fne, tokenize, ``info --repair``) holds
the lock of what it writes for the whole run: ``STORE/.vsekit/locks/NAME.lock``. An exclusive create
is atomic on local disks and on NFS v3+/Lustre/GPFS, so the lock works on a cluster's shared
filesystem. The file holds the writer's host, pid, the pid's start time and the run's start time.

A lock is *stale*, and broken by the next writer, when

* its host is this host and its process is gone (or the pid now belongs to another process): this is
  what a ``kill -9`` or a crash leaves behind;
* its host is another host and the holder has not refreshed it for ``VSEKIT_LOCK_STALE_S`` seconds
  (default 3600). A holder refreshes its file's modification time every minute from a daemon thread.

``VSEKIT_BREAK_LOCK=1`` breaks any lock (when you know the other writer is dead). The lock is
released when the run ends, also on an exception or Ctrl-C. A process that holds a lock can take it
again (``fne`` writes two sets), and the lock only counts once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from .store import StoreError

LOCK_DIR = (".vsekit", "locks")
STALE_ENV, BREAK_ENV = "VSEKIT_LOCK_STALE_S", "VSEKIT_BREAK_LOCK"
DEFAULT_STALE_S = 3600.0
HEARTBEAT_S = 60.0
_GROUP_JSON = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'

_held: dict[str, int] = {}       # lock path → depth, for this process
_held_lock = threading.Lock()


class LockHeld(StoreError):
    """Another live run holds the lock; the message names it and the way out."""


def lock_path(store_path: str | os.PathLike, name: str) -> Path:
    """The lock file of ``name`` (a feature set name, ``tokens``, ...) in the store at ``store_path``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return Path(store_path).joinpath(*LOCK_DIR) / f"{safe}.lock"


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to detect a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}   # torn or foreign content: judged by age below


def stale_reason(path: Path, info: dict) -> str | None:
    """Why the lock ``info`` at ``path`` is stale, or None if its holder may still be running."""
    if os.environ.get(BREAK_ENV) == "1":
        return f"{BREAK_ENV}=1"
    if info.get("slurm_array"):   # held by a SLURM job array (extract --cluster slurm-array:N)
        from .arrays import lock_stale_reason

        return lock_stale_reason(path, info, float(os.environ.get(STALE_ENV, DEFAULT_STALE_S)))
    host, pid = info.get("host"), info.get("pid")
    if host == socket.gethostname() and isinstance(pid, int):
        if not _alive(pid):
            return f"process {pid} on {host} is gone"
        start = info.get("proc_start")
        if start is not None and _proc_start(pid) not in (None, start):
            return f"pid {pid} on {host} now belongs to another process"
        return None
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return "released"
    limit = float(os.environ.get(STALE_ENV, DEFAULT_STALE_S))
    if age > limit:
        return f"not refreshed for {age:.0f}s (more than {STALE_ENV}={limit:.0f})"
    return None


def describe(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return (f"{info.get('stage', 'a vsekit run')} (pid {info.get('pid', '?')} on host "
            f"{info.get('host', '?')}, started {when})")


def _ensure_dir(store_path: Path) -> Path:
    meta = store_path / LOCK_DIR[0]
    (meta / LOCK_DIR[1]).mkdir(parents=True, exist_ok=True)
    if not (meta / "zarr.json").exists():   # a Zarr group, so listing the store root stays quiet
        (meta / "zarr.json").write_bytes(_GROUP_JSON)
    return meta / LOCK_DIR[1]


def _try_create(path: Path, info: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _break(path: Path, seen: dict) -> None:
    """Remove the stale lock ``seen``: move it aside first, and put it back if another run replaced it."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != seen:   # a live writer took the lock between our read and our rename
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink(missing_ok=True)


def acquire(store_path: str | os.PathLike, name: str, stage: str) -> dict:
    """Take the lock of ``name`` or raise :class:`LockHeld`; returns what was written in it."""
    path = lock_path(store_path, name)
    _ensure_dir(Path(store_path))
    info = {"host": socket.gethostname(), "pid": os.getpid(), "proc_start": _proc_start(os.getpid()),
            "started": time.time(), "stage": stage, "token": uuid.uuid4().hex}
    for _ in range(5):
        if _try_create(path, info):
            return info
        seen = _read(path)
        if seen is None:
            continue
        if stale_reason(path, seen) is None:
            raise LockHeld(
                f"{name!r} in {store_path} is being written by {describe(seen)}; wait for it to "
                f"finish (one writer per feature set). If that run is dead on another host, remove "
                f"{path} or rerun with {BREAK_ENV}=1")
        _break(path, seen)
    raise LockHeld(f"could not take the lock {path}: other runs keep taking it")


def release(store_path: str | os.PathLike, name: str, info: dict) -> None:
    """Remove the lock file if it is still ours."""
    path = lock_path(store_path, name)
    current = _read(path)
    if current and current.get("token") == info.get("token"):
        path.unlink(missing_ok=True)


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(path)


@contextlib.contextmanager
def writer_lock(store_path: str | os.PathLike, *names: str, stage: str = "vsekit") -> Iterator[None]:
    """Hold the locks of ``names`` (in sorted order, so two runs never deadlock) for the block."""
    taken: list[tuple[str, dict | None]] = []
    stop = threading.Event()
    try:
        for name in sorted(set(names)):
            key = str(lock_path(store_path, name).resolve())
            with _held_lock:
                if key in _held:
                    _held[key] += 1
                    taken.append((name, None))
                    continue
            info = acquire(store_path, name, stage)
            with _held_lock:
                _held[key] = 1
            taken.append((name, info))
            threading.Thread(target=_heartbeat, args=(lock_path(store_path, name), stop),
                             name=f"vsekit-lock-{name}", daemon=True).start()
        yield
    finally:
        stop.set()
        for name, info in reversed(taken):
            key = str(lock_path(store_path, name).resolve())
            with _held_lock:
                _held[key] -= 1
                last = _held[key] == 0
                if last:
                    del _held[key]
            if last and info is not None:
                release(store_path, name, info)


def holder(store_path: str | os.PathLike, name: str) -> dict | None:
    """The live holder of ``name``'s lock, or None (a stale lock counts as none)."""
    path = lock_path(store_path, name)
    info = _read(path)
    if not info or stale_reason(path, info) is not None:
        return None
    return info
