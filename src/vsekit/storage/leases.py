"""The one lease of every write guard (a set's writer lock or lease, the store's, the ``tokens``', a
job array's hold of a set, a block's lease in a job array): one class, :class:`Lease` (take, take
over, renew, hold, release), over a small :class:`Backend` (create if absent, read with a version
and an expiry, replace if still at that version, delete while it holds the holder's token), one ttl
(:data:`DEFAULT_TTL_S`, ``VSEKIT_LEASE_TTL_S``) and one takeover rule (:func:`free_reason`).
Backends: a lock file (:class:`.lock.LockFile`), a block's generations of files
(:class:`GenerationFiles`) and an object (:class:`.objstore.LeaseObject`); docs/store.md, "Write
guards: states and transitions", draws their states and transitions with their tests.

A holder commits only while :meth:`Lease.held` (no later record, more than ``margin`` seconds left),
so a holder and the task that takes its block over never both pass the check before committing,
provided the hosts' clocks agree to well under ``margin`` and a holder is never frozen (SIGSTOP) for
longer than that between its check and the end of its commit.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..schedulers import get as get_scheduler, this_task
from .base import DEFAULT_STALE_S, STALE_ENV, LeaseLost, StoreError

DEFAULT_TTL_S = 60.0
TTL_ENV = "VSEKIT_LEASE_TTL_S"


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


# --- the one lease ----------------------------------------------------------------------------------
class Backend:
    """Where a lease's record lives (see the module's docstring); the defaults suit a backend whose
    renewal is a replacement (object storage)."""

    def free_reason(self, info: dict, expires: float, now: float) -> str | None:
        return free_reason(info, expires, now)

    def touch(self, body: dict, expires: float, version: Any) -> Any:
        return self.replace(body, expires, version)

    def lost(self, version: Any) -> bool:
        return False

    def close(self) -> None:
        pass


class Lease:
    """A guard this process takes and holds over ``backend``: ``record`` (what the holder says of
    itself) plus a ``token`` and the ``ttl``. ``free_record``: a release leaves a free record (a
    block's lease: its history stays) rather than deleting it. ``clock``: where the time comes from."""

    def __init__(self, backend: Backend, record: dict | None = None, ttl: float | None = None,
                 token: str | None = None, free_record: bool = False, clock: Any = time):
        self.backend, self.record, self.clock, self.free_record = backend, dict(record or {}), clock, free_record
        self.ttl = default_ttl() if ttl is None else float(ttl)
        self.token = token or uuid.uuid4().hex
        self.version: Any = None
        self.expires = 0.0
        self.stolen_from: dict | None = None
        self.key: Any = None   # what it guards, for its users (a block's index)
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def body(self) -> dict:
        return {**self.record, "token": self.token, "ttl": self.ttl}

    def take(self, now: float | None = None, tries: int = 1) -> dict | None:
        """Take the guard: None when taken; else the record of the holder that keeps it (``{}``:
        others took it at the same moment ``tries`` times). A free or expired guard (the backend's
        :meth:`Backend.free_reason`) is taken over by a replacement of the version just read."""
        now = self.clock.time() if now is None else now
        for _ in range(tries):
            version = self.backend.create(self.body(), now + self.ttl)
            if version is None:
                got = self.backend.read()
                if got is None:   # released meanwhile
                    continue
                info, seen, expires = got
                if self.backend.free_reason(info, expires, now) is None:
                    return info
                version = self.backend.replace(self.body(), now + self.ttl, seen)
                if version is None:
                    continue
                self.stolen_from = None if info.get("free") else info
            self.version, self.expires = version, now + self.ttl
            return None
        return {}

    def renew(self) -> bool:
        """Push the expiry to ``ttl`` from now; False once another record replaced the holder's."""
        with self.lock:
            if self.version is None:
                return False
            now = self.clock.time()
            version = self.backend.touch(self.body(), now + self.ttl, self.version)
            if version is not None:
                self.expires = now + self.ttl
            self.version = version
            return version is not None

    def held(self, margin: float = 0.0) -> bool:
        """Whether this process still holds the guard, with more than ``margin`` seconds left."""
        with self.lock:
            return (self.version is not None and not self.backend.lost(self.version)
                    and self.clock.time() + margin < self.expires)

    def release(self) -> None:
        """Give the guard up while it is still this holder's: a free record, or no record."""
        self._stop.set()
        with self.lock:
            if self.version is None:
                return
            try:
                if self.free_record:
                    self.backend.replace({"free": True, "released_by": self.token}, 0.0, self.version)
                else:
                    self.backend.delete(self.token)
            finally:
                self.version = None
                self.backend.close()

    def keep_renewed(self, every: float, errors: tuple = (OSError,)) -> "Lease":
        """Renew every ``every`` seconds from a daemon thread until released (or a renewal fails)."""
        def loop() -> None:
            while not self._stop.wait(every):
                try:
                    self.renew()
                except errors:
                    return

        threading.Thread(target=loop, name="vsekit-lease", daemon=True).start()
        return self


class JointLease(Lease):
    """A set's guard as the tasks of a job array hold it together, under the array's ``token`` (handed
    to it by :meth:`.sets.SetStorage.hand_over`): each task renews it while the record still holds that
    token (a touch of the lock file; a compare-and-swap of a later expiry of the object, read again when
    a sibling renewed it in between). Once another run took it over, :meth:`renew` and :meth:`check`
    raise :class:`LeaseLost` naming ``what``. A task never releases it: the array's guard expires
    after its job has ended."""

    def __init__(self, backend: Backend, what: str, token: str, ttl: float):
        super().__init__(backend, token=token, ttl=ttl)
        self.what = what

    def renew(self) -> bool:
        with self.lock:
            for _ in range(20):
                got = self.backend.read()
                if got is None or got[0].get("token") != self.token:
                    raise LeaseLost(f"{self.what} is no longer this job array's (another run took it over); "
                                    f"not committing")
                info, version, _ = got
                self.ttl = float(info.get("ttl") or self.ttl)
                expires = self.clock.time() + self.ttl
                if self.backend.touch(info, expires, version) is not None:
                    self.expires = expires
                    return True
                time.sleep(0.05)   # a sibling task renewed it in between: read it again
        return False

    def check(self) -> None:
        """Renew now; raise :class:`LeaseLost` unless the array still holds the guard for half a ttl."""
        self.renew()
        if self.clock.time() > self.expires - self.ttl / 2:   # the renewal itself took too long
            raise LeaseLost(f"{self.what} is about to expire; not committing")

    def release(self) -> None:
        self._stop.set()


# --- a job array's block leases ---------------------------------------------------------------------
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


class BlockLeases:
    """The leases of one feature set's blocks, one :class:`Lease` per block over ``backend(key)``;
    ``keys()`` lists the blocks that have a record (:func:`LeaseDir` on a disk,
    :func:`.objleases.ObjectLeaseDir` on object storage)."""

    def __init__(self, backend: Callable[[int], Backend], keys: Callable[[], Iterable[int]],
                 ttl: float | None = None, owner: dict | None = None, clock: Any = time):
        self.backend, self.keys, self.clock = backend, keys, clock
        self.ttl = float(ttl if ttl is not None else default_ttl())
        self.owner = owner if owner is not None else owner_record()

    def claim(self, key: int) -> Lease | None:
        """Take the lease of ``key`` if it is free or expired; None if another task holds it (or
        won it at the same moment)."""
        now = self.clock.time()
        lease = Lease(self.backend(key), dict(self.owner, block=int(key), taken=now), self.ttl,
                      free_record=True, clock=self.clock)
        if lease.take(now) is not None:
            lease.backend.close()
            return None
        lease.key = int(key)
        return lease

    def renew(self, lease: Lease) -> None:
        """Push the expiry of ``lease`` to ``ttl`` seconds from now, if nobody else took it since (a
        server that does not answer leaves it to run out, unless a later renewal works)."""
        with contextlib.suppress(StoreError):
            lease.renew()

    def held(self, lease: Lease, margin: float | None = None) -> bool:
        """Whether ``lease`` is still this process's, with more than ``margin`` seconds left."""
        return lease.held(self.ttl / 4 if margin is None else margin)

    def release(self, lease: Lease) -> None:
        """Mark the block free, only if the lease is still this process's (unreachable: it expires)."""
        with contextlib.suppress(StoreError):
            lease.release()

    def state(self, key: int) -> LeaseState | None:
        """The current lease of ``key``; None if it has none."""
        got = self.backend(key).read()
        if got is None:
            return None
        info, version, expires = got
        return LeaseState(int(key), version if isinstance(version, int) else 0, info, expires)

    def states(self) -> Iterator[LeaseState]:
        """The current lease of every block that has one and is not free (live or expired)."""
        for k in sorted(set(self.keys())):
            s = self.state(k)
            if s is not None and not s.free:
                yield s


class GenerationFiles(Backend):
    """A block's lease on a POSIX disk: files ``DIR/b000042.g0.lease``, ``...g1.lease``, ..., the
    current one the highest generation present, its expiry its modification time plus its ttl. Every
    write hard-links a complete record under the next generation's name (``os.link`` fails when the
    name exists, atomically on local disks and on NFS v3+/Lustre/GPFS), so of any number of
    contenders exactly one wins and nothing is ever renamed over or deleted while it may be current.
    The holder renews by touching its own file through the descriptor it keeps open."""

    def __init__(self, root: Path, key: int):
        self.root, self.key, self.fd = root, int(key), -1

    def path(self, gen: int) -> Path:
        return self.root / f"b{self.key:06d}.g{int(gen)}.lease"

    def current(self) -> int:
        gen = -1
        while os.path.exists(self.path(gen + 1)):
            gen += 1
        return gen

    def _link(self, body: dict, gen: int) -> int | None:
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            os.write(fd, json.dumps(body).encode())
            os.fsync(fd)
            os.link(tmp, self.path(gen))
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, FileExistsError):
                return None
            raise
        finally:
            tmp.unlink(missing_ok=True)
        os.utime(fd)   # the expiry counts from the link
        self.close()
        self.fd = fd
        return gen

    def create(self, body: dict, expires: float) -> int | None:
        return self._link(body, 0)

    def read(self) -> tuple[dict, int, float] | None:
        gen = self.current()
        try:
            st = os.stat(self.path(gen))
            info = json.loads(self.path(gen).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            info = {}
        return info, gen, st.st_mtime + float(info.get("ttl") or default_ttl())

    def replace(self, body: dict, expires: float, version: int) -> int | None:
        return self._link(body, version + 1)

    def touch(self, body: dict, expires: float, version: int) -> int:
        if self.fd >= 0:
            os.utime(self.fd)
        return version

    def lost(self, version: int) -> bool:
        return self.fd < 0 or os.path.exists(self.path(version + 1))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.fd >= 0:
                os.close(self.fd)
        self.fd = -1


_NAME = re.compile(r"^b(\d+)\.g(\d+)\.lease$")


def LeaseDir(root: str | os.PathLike, ttl: float | None = None, owner: dict | None = None) -> BlockLeases:
    """The block leases of one feature set in folder ``root`` (created if missing)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)

    def keys() -> list[int]:
        with contextlib.suppress(FileNotFoundError):
            return [int(m.group(1)) for m in map(_NAME.match, os.listdir(root)) if m]
        return []

    return BlockLeases(lambda key: GenerationFiles(root, key), keys, ttl, owner)


__all__ = ["Backend", "BlockLeases", "DEFAULT_TTL_S", "GenerationFiles", "JointLease", "Lease", "LeaseDir", "LeaseState",
           "TTL_ENV", "default_ttl", "free_reason", "gone_here", "owner_record"]
