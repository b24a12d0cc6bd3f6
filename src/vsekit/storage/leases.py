"""The one ttl and the one takeover rule of every write guard, and block leases (which task of a job
array is writing which row block, and until when) on a POSIX disk.

Every guard (a set's writer lock or lease, the store's, a block's lease, a job array's hold of a set)
expires ``ttl`` seconds (:data:`DEFAULT_TTL_S`, ``VSEKIT_LEASE_TTL_S``) after its holder last renewed
it; holders renew every ttl/3. :func:`free_reason` is the one rule by which another run may take a
guard over (docs/store.md, "Write guards: states and transitions").

The lease of block K is a sequence of small files ``DIR/b000042.g0.lease``, ``...g1.lease``, ...;
the *current* lease is the highest generation present. Each file is a JSON record: the owner's job,
array task, host, pid, a random token and the time-to-live, or ``{"free": true}`` for a released
lease. A lease's *expiry* is its file's modification time plus ``ttl``: the holder renews it by
touching its own file through the descriptor it keeps open (``os.utime(fd)``).

* **Claim, take over, release** are all the same atomic step: hard-link a complete record into the
  next generation's name (``os.link`` fails when the name exists, atomically on local disks and on
  NFS v3+/Lustre/GPFS). A free block (no file, or a free record) or one whose current lease has
  expired is claimed by linking generation n+1; of any number of contenders for generation n+1
  exactly one succeeds. Nothing is ever renamed over or deleted while it may be current, so no
  contender can remove or replace a winner's file.
* **Holding** (:meth:`LeaseDir.held`): no generation after the holder's exists, and more than
  ``margin`` seconds remain before its lease expires. A block is committed only after this check
  (and the block's own status check); a holder that lost its lease drops the block.

A takeover needs the current lease to have expired, and a holder only commits with ``margin``
seconds left, so a holder and the task that takes its block over never both pass the check before
committing, provided the hosts' clocks agree to well under ``margin`` and a holder is never frozen
(SIGSTOP) for longer than that between its check and the end of its commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..schedulers import get as get_scheduler, this_task
from .base import DEFAULT_STALE_S, STALE_ENV

DEFAULT_TTL_S = 60.0
TTL_ENV = "VSEKIT_LEASE_TTL_S"
_NAME = re.compile(r"^b(\d+)\.g(\d+)\.lease$")


def default_ttl() -> float:
    return float(os.environ.get(TTL_ENV, DEFAULT_TTL_S))


def proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), to detect a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def gone_here(info: dict) -> str | None:
    """Why the holder ``info`` is known to be gone: it ran on this host and its pid is gone or now
    belongs to another process (what a ``kill -9`` leaves); None when it may still run."""
    host, pid = info.get("host"), info.get("pid")
    if host != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} on {host} is gone"
    except PermissionError:
        return None
    start = info.get("proc_start")
    if start is not None and proc_start(pid) not in (None, start):
        return f"pid {pid} on {host} now belongs to another process"
    return None


def free_reason(info: dict, expires: float, now: float | None = None) -> str | None:
    """THE takeover rule of every guard: why ``info`` (expiring at ``expires``, its holder's clock) may
    be taken over at ``now`` (default: this host's clock), or None while its holder keeps it.

    Free: released; its holder ran on this host and is gone (at once); it expired (not renewed for a
    ttl). A job array's guard (``array_job``/``array_scheduler``) is kept while the scheduler lists
    the job, and until it expires even once the job has left (a task still ending would renew it);
    where the scheduler cannot answer, until ``VSEKIT_LOCK_STALE_S`` past its expiry."""
    if info.get("free"):
        return "released"
    left = float(expires) - (time.time() if now is None else now)
    job = info.get("array_job") or info.get("slurm_array")
    if job or "array_scheduler" in info:
        sched = get_scheduler(info.get("array_scheduler"))
        alive = sched.job_alive(job)
        grace = float(os.environ.get(STALE_ENV, DEFAULT_STALE_S)) if alive is None else 0.0
        if alive is True or left + grace > 0:
            return None
        return f"{sched.label} job array {job} has ended and its lease expired"
    gone = gone_here(info)
    if gone is not None:
        return gone
    if left <= 0:
        return f"not renewed for {float(info.get('ttl') or default_ttl()) - left:.0f}s (it expired)"
    return None


def owner_record() -> dict:
    """Who is claiming: the batch job and array task (when inside one), host and pid."""
    job, task = this_task()   # the task as its scheduler numbers it
    return {"job": job, "task": task, "host": socket.gethostname(), "pid": os.getpid()}


def holder_words(info: dict, expires: float) -> str | None:
    """Who holds the guard ``info`` and when it may be taken (words for an Error line), or None when
    it may be taken now (:func:`free_reason`)."""
    if free_reason(info, expires) is not None:
        return None
    left = float(expires) - time.time()
    job = info.get("array_job") or info.get("slurm_array")
    if job or "array_scheduler" in info:
        sched = get_scheduler(info.get("array_scheduler"))
        who = f"{sched.label} job array {job or '(being submitted)'} ({info.get('stage', 'vsekit extract')})"
        alive = sched.job_alive(job)
        if alive is True:
            return f"{who}; wait for it to end, or cancel it ({sched.cancel_hint(job)})"
        if left > 0:   # even once the job has left the queue: a task still ending would renew it
            ended = "its job has ended and " if alive is False else ""
            return f"{who}; {ended}its lease expires in {left:.0f} s: rerun then"
        return (f"{who}; {sched.status} cannot answer here, so its lease is "
                f"kept until {STALE_ENV}={os.environ.get(STALE_ENV, DEFAULT_STALE_S)} s past its expiry")
    return (f"another run ({info.get('stage', 'vsekit')}, pid {info.get('pid')} on {info.get('host')}); its "
            f"lease expires in {left:.0f} s unless renewed. Wait for it to finish, or rerun once it has stopped")


@dataclass
class Lease:
    """A lease this process holds: its block, generation, file, open descriptor and token."""

    key: int
    gen: int
    path: Path
    fd: int
    token: str
    ttl: float
    stolen_from: dict | None = None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


@dataclass
class LeaseState:
    """The current lease of a block, as any process sees it (for ``vsekit info`` and takeovers)."""

    key: int
    gen: int
    owner: dict = field(default_factory=dict)
    expires: float = 0.0

    @property
    def free(self) -> bool:
        return bool(self.owner.get("free"))

    @property
    def expired(self) -> bool:
        return time.time() > self.expires


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class LeaseDir:
    """The leases of one feature set's blocks, in folder ``root`` (created if missing)."""

    def __init__(self, root: str | os.PathLike, ttl: float | None = None, owner: dict | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ttl = float(ttl if ttl is not None else default_ttl())
        self.owner = owner if owner is not None else owner_record()

    def path(self, key: int, gen: int) -> Path:
        return self.root / f"b{int(key):06d}.g{int(gen)}.lease"

    def current(self, key: int) -> int:
        """The highest generation present for ``key`` (-1: none)."""
        gen = -1
        while os.path.exists(self.path(key, gen + 1)):
            gen += 1
        return gen

    # --- taking --------------------------------------------------------------------------------
    def _record(self, key: int, body: dict) -> tuple[Path, int]:
        """``body`` in a private temporary file (kept open); returns (path, fd)."""
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
        return tmp, fd

    def claim(self, key: int) -> Lease | None:
        """Take the lease of ``key`` if it is free or expired; None if another task holds it (or
        won it at the same moment)."""
        gen = self.current(key)
        before = self.state(key, gen) if gen >= 0 else None
        if before is not None and free_reason(before.owner, before.expires) is None:
            return None
        token = uuid.uuid4().hex
        tmp, fd = self._record(key, dict(self.owner, token=token, ttl=self.ttl, block=int(key),
                                         taken=time.time()))
        try:
            os.link(tmp, self.path(key, gen + 1))
        except FileExistsError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        os.utime(fd)   # the expiry counts from the link
        stolen = before.owner if before is not None and not before.free else None
        return Lease(key, gen + 1, self.path(key, gen + 1), fd, token, self.ttl, stolen_from=stolen)

    # --- holding -------------------------------------------------------------------------------
    def renew(self, lease: Lease) -> None:
        """Push the expiry of ``lease`` to ``ttl`` seconds from now (touches only the holder's file)."""
        if lease.fd >= 0:
            os.utime(lease.fd)

    def held(self, lease: Lease, margin: float | None = None) -> bool:
        """Whether ``lease`` is still this process's, with more than ``margin`` seconds left."""
        if lease.fd < 0:
            return False
        margin = self.ttl / 4 if margin is None else margin
        if os.path.exists(self.path(lease.key, lease.gen + 1)):
            return False           # released, or taken over after it expired
        return time.time() + margin < os.fstat(lease.fd).st_mtime + lease.ttl

    def release(self, lease: Lease) -> None:
        """Mark the block free (the next generation, unless a takeover already made it), and close."""
        if lease.fd < 0:
            return
        try:
            tmp, fd = self._record(lease.key, {"free": True, "released_by": lease.token})
            os.close(fd)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, self.path(lease.key, lease.gen + 1))
            tmp.unlink(missing_ok=True)
        finally:
            lease.close()

    # --- looking -------------------------------------------------------------------------------
    def state(self, key: int, gen: int | None = None) -> LeaseState | None:
        """The lease of ``key`` at generation ``gen`` (default: the current one); None if absent."""
        gen = self.current(key) if gen is None else gen
        path = self.path(key, gen)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        info = _read(path)
        return LeaseState(key, gen, info, st.st_mtime + float(info.get("ttl") or self.ttl))

    def states(self) -> Iterator[LeaseState]:
        """The current lease of every block that has one and is not free (live or expired)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        top: dict[int, int] = {}
        for n in names:
            m = _NAME.match(n)
            if m:
                k, g = int(m.group(1)), int(m.group(2))
                top[k] = max(top.get(k, -1), g)
        for k in sorted(top):
            s = self.state(k, top[k])
            if s is not None and not s.free:
                yield s


__all__ = ["DEFAULT_TTL_S", "Lease", "LeaseDir", "LeaseState", "TTL_ENV", "default_ttl", "free_reason", "gone_here",
           "owner_record"]
