"""Block leases: which task of a SLURM job array is writing which row block, and until when.

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

from ..schedulers import this_task

DEFAULT_TTL_S = 300.0
TTL_ENV = "VSEKIT_LEASE_TTL_S"
_NAME = re.compile(r"^b(\d+)\.g(\d+)\.lease$")


def default_ttl() -> float:
    return float(os.environ.get(TTL_ENV, DEFAULT_TTL_S))


def owner_record() -> dict:
    """Who is claiming: the batch job and array task (when inside one), host and pid."""
    job, task = this_task()   # the task as its scheduler numbers it
    return {"job": job, "task": task, "host": socket.gethostname(), "pid": os.getpid()}


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
        if before is not None and not before.free and not before.expired:
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


__all__ = ["DEFAULT_TTL_S", "Lease", "LeaseDir", "LeaseState", "TTL_ENV", "default_ttl", "owner_record"]
