"""One writer per feature set on a disk: the lock file backend of the one lease (:class:`LockFile`)
and the store's locks (docs/store.md, "Write guards: states and transitions").

Every stage that writes holds the lock of what it writes for the whole run,
``STORE/.vsekit/locks/NAME.lock``, refreshed every ttl/3 and released when the run ends (also on an
exception or Ctrl-C); a process that holds a lock can take it again (``fne`` writes two sets) and it
counts once. ``VSEKIT_BREAK_LOCK=1`` breaks any lock. A store has locks of its own: ``ingest`` holds
``.S.ingest.lock`` beside the store ``S`` while it creates it (one ingest per path), and ``ingest
--overwrite`` holds ``S/.vsekit/locks/.store.lock`` while it replaces ``S`` (refused while any writer
holds a lock in ``S``; writers refused meanwhile).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from .fserrors import naming
from .job_arrays import write_json
from .base import STALE_ENV, StoreError  # noqa: F401 (re-exported: a job array's grace where its scheduler cannot answer)
from .leases import DEFAULT_TTL_S, Backend, Lease, default_ttl, free_reason, gone_here, holder_words, proc_start
from .objstore import SERVED_BY, is_object_url, public_url

LOCK_DIR = (".vsekit", "locks")
BREAK_ENV = "VSEKIT_BREAK_LOCK"
HEARTBEAT_S = DEFAULT_TTL_S / 3   # the longest wait between two refreshes (a third of the ttl, or less)
_GROUP_JSON = b'{"zarr_format": 3, "node_type": "group", "attributes": {}}'

_held: dict[str, int] = {}       # lock path → depth, for this process
_held_lock = threading.Lock()


class LockHeld(StoreError):
    """Another live run holds the lock; the message names it and the way out."""


def lock_path(store_path: str | os.PathLike, name: str) -> Path:
    """The lock file of ``name`` (a feature set name, ``tokens``, ...) in the store at ``store_path``."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    return Path(store_path).joinpath(*LOCK_DIR) / f"{safe}.lock"


_proc_start = proc_start


TORN = {"torn": True}   # what _read returns for an empty or unparsable lock file


def _read(path: Path) -> dict | None:
    """The lock's content, None if there is no lock, or ``TORN`` if it is empty or not a JSON object."""
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return dict(TORN)
    return info if isinstance(info, dict) and info else dict(TORN)


def stale_reason(path: Path, info: dict) -> str | None:
    """Why the lock ``info`` at ``path`` is stale, or None if its holder may still be running."""
    if os.environ.get(BREAK_ENV) == "1":
        return f"{BREAK_ENV}=1"
    if info.get("torn"):   # locks are linked into place complete, so no live writer left this
        return "the lock file is empty or torn (left by a run that failed while writing it)"
    # on a disk, a live holder on this host (not a job array) keeps its lock, expired or not: tokenize,
    # split and info --repair write without a check per block
    if (info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int)
            and not (info.get("array_job") or info.get("slurm_array")) and gone_here(info) is None):
        return None
    try:
        return free_reason(info, _expires(path, info))
    except FileNotFoundError:
        return "released"


def _expires(path: Path, info: dict) -> float:
    """A lock file's expiry: its last refresh (modification time) plus the ttl its holder records."""
    return path.stat().st_mtime + float(info.get("ttl") or default_ttl())


def describe(info: dict) -> str:
    """Who holds a guard, in words: its stage, pid and host (and when it started, where recorded)."""
    started = info.get("started")
    when = f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" if started else ""
    return f"{info.get('stage', 'a vsekit run')} (pid {info.get('pid', '?')} on host {info.get('host', '?')}{when})"


def _ensure_dir(store_path: Path) -> Path:
    meta = store_path / LOCK_DIR[0]
    with naming(meta):
        (meta / LOCK_DIR[1]).mkdir(parents=True, exist_ok=True)
        if not (meta / "zarr.json").exists():   # a Zarr group, so listing the store root stays quiet
            (meta / "zarr.json").write_bytes(_GROUP_JSON)
    return meta / LOCK_DIR[1]


def _try_create(path: Path, info: dict) -> bool:
    """Write the lock complete or not at all: a temporary file, fsync'd, then ``link()``ed into place.

    ``link`` is atomic and fails if the lock exists (also on NFS v3+), so the lock file never exists
    half-written: a full disk fails on the temporary file, which is removed, and leaves no lock. A
    filesystem without hard links (vfat, some FUSE mounts) gets ``O_CREAT | O_EXCL``, then the
    content: a lock another run reads in the instant between the two looks torn there, and a write
    that fails removes the file again, so a full disk still leaves no lock.
    """
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with naming(path):
        try:
            _write_synced(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), info, tmp)
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            _write_synced(fd, info, path)
        finally:
            tmp.unlink(missing_ok=True)
    return True


_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


def _write_synced(fd: int, info: dict, path: Path) -> None:
    """``info`` as JSON into the new file ``fd``, fsync'd; on a failure ``path`` is removed."""
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _break(path: Path, seen: dict) -> None:
    """Remove the stale lock ``seen``: move it aside first, and put it back if another run replaced it."""
    aside = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != seen:   # a live writer took the lock between our read and our rename
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            if not path.exists():   # no hard links here: put it back by name
                os.rename(aside, path)
    aside.unlink(missing_ok=True)


class LockFile(Backend):
    """The POSIX-file backend of the one lease (:class:`.leases.Lease`): a lock file linked into
    place complete (create), read with its content as its version and its modification time plus
    its ttl as its expiry, replaced by moving the stale one aside and linking a new one, renewed by
    touching it, deleted while it holds the holder's token. Its takeover rule is
    :func:`stale_reason`: the one rule, except that a live holder on this host keeps its lock."""

    def __init__(self, path: Path):
        self.path = path

    def free_reason(self, info: dict, expires: float, now: float) -> str | None:
        return stale_reason(self.path, info)

    def create(self, body: dict, expires: float) -> dict | None:
        return body if _try_create(self.path, body) else None

    def read(self) -> tuple[dict, dict, float] | None:
        info = _read(self.path)
        if info is None:
            return None
        try:
            return info, info, _expires(self.path, info)
        except FileNotFoundError:
            return None

    def replace(self, body: dict, expires: float, version: dict) -> dict | None:
        _break(self.path, version)
        return self.create(body, expires)

    def touch(self, body: dict, expires: float, version: dict) -> dict:
        with contextlib.suppress(OSError):
            os.utime(self.path)
        return version

    def delete(self, token: str) -> None:
        current = _read(self.path)
        if current and current.get("token") == token:
            self.path.unlink(missing_ok=True)


def hand_over(store_path: str | os.PathLike, name: str, token: str, extra: dict) -> Callable[[], None]:
    """Rewrite the lock of ``name`` (held by this process) as a job array's: its ``token`` and
    ``extra`` (job id, scheduler, stage); returns what writes the lock back as it was."""
    path = lock_path(store_path, name)
    before = json.loads(path.read_text())
    write_json(path, dict(before, token=token, **extra))
    return lambda: write_json(path, before)


def refuse_url(store_path: str | os.PathLike, stage: str = "this stage") -> None:
    """A lock file cannot live on object storage: a writer that has no lease protocol yet is refused
    there (a library call or a `vsekit run` recipe), rather than making a local folder named ``s3:``."""
    if is_object_url(os.fspath(store_path)):
        raise StoreError(f"{public_url(os.fspath(store_path))}: {stage} does not serve stores on object storage "
                         f"yet; they are served by {SERVED_BY} (issue 35)")


def _take(path: Path, what: str, stage: str, rule: str) -> Lease:
    """Take the lock file ``path`` (of ``what``) or raise :class:`LockHeld` naming its holder."""
    lease = Lease(LockFile(path), {"host": socket.gethostname(), "pid": os.getpid(),
                                   "proc_start": _proc_start(os.getpid()), "started": time.time(), "stage": stage})
    seen = lease.take(tries=5)
    if seen is None:
        return lease
    if not seen:
        raise LockHeld(f"could not take the lock {path}: other runs keep taking it")
    if seen.get("array_job") or seen.get("slurm_array"):
        raise LockHeld(f"{what} is being written by {holder_words(seen, _expires(path, seen))}")
    raise LockHeld(f"{what} is being written by {describe(seen)}; wait for it to finish ({rule}). If that "
                   f"run is dead on another host, remove {path} or rerun with {BREAK_ENV}=1")


def _renewed(lease: Lease) -> Lease:
    """``lease`` refreshed every ttl/3 (or :data:`HEARTBEAT_S`) while held, so other runs keep waiting."""
    return lease.keep_renewed(min(HEARTBEAT_S, lease.ttl / 3))


def _take_in(store_path: str | os.PathLike, name: str, stage: str) -> Lease:
    refuse_url(store_path)
    _ensure_dir(Path(store_path))
    return _take(lock_path(store_path, name), f"{name!r} in {store_path}", stage, "one writer per feature set")


def acquire(store_path: str | os.PathLike, name: str, stage: str) -> dict:
    """Take the lock of ``name`` or raise :class:`LockHeld`; returns what was written in it."""
    return _take_in(store_path, name, stage).body()


def release(store_path: str | os.PathLike, name: str, info: dict) -> None:
    """Remove the lock file if it is still ours."""
    LockFile(lock_path(store_path, name)).delete(info.get("token"))


# the store's own locks ------------------------------------------------------------------------------
@contextlib.contextmanager
def creating_store(store_path: str | os.PathLike, stage: str = "vsekit ingest") -> Iterator[None]:
    """Hold the creation lock of the store at ``store_path``: one ingest at a time into one path
    (two ingests into the same new path would otherwise both succeed, the second replacing the first)."""
    path = Path(store_path).parent / f".{Path(store_path).name}.ingest.lock"
    with naming(path.parent):
        path.parent.mkdir(parents=True, exist_ok=True)
    lease = _renewed(_take(path, f"{Path(store_path)}", stage, "one ingest per store path"))
    try:
        yield
    finally:
        lease.release()


@contextlib.contextmanager
def writer_lock(store_path: str | os.PathLike, *names: str, stage: str = "vsekit",
                check: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold the locks of ``names`` (in sorted order, so two runs never deadlock) for the block;
    ``check()`` runs after each is taken (:meth:`.sets.SetStorage.refuse_if_store_held`)."""
    refuse_url(store_path, f"`{stage}`")
    taken: list[tuple[str, Lease | None]] = []
    try:
        for name in sorted(set(names)):
            key = str(lock_path(store_path, name).resolve())
            with _held_lock:
                if key in _held:
                    _held[key] += 1
                    taken.append((key, None))
                    continue
            lease = _take_in(store_path, name, stage)
            with _held_lock:
                _held[key] = 1
            taken.append((key, lease))
            check()
            _renewed(lease)
        yield
    finally:
        for key, lease in reversed(taken):
            with _held_lock:
                _held[key] -= 1
                last = _held[key] == 0
                if last:
                    del _held[key]
            if last and lease is not None:
                lease.release()


def holder(store_path: str | os.PathLike, name: str) -> dict | None:
    """The live holder of ``name``'s lock, or None (a stale lock counts as none)."""
    got = live(lock_path(store_path, name))
    return None if got is None else got[0]


def live(path: Path) -> tuple[dict, float] | None:
    """The record of the lock file ``path`` and its expiry while its holder keeps it, else None."""
    info = _read(path)
    if not info or stale_reason(path, info) is not None:
        return None
    try:
        return info, _expires(path, info)
    except FileNotFoundError:
        return None
