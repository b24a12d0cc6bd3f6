"""Block leases: which task of a SLURM job array is writing which row block, and until when.

Every lease is one small file ``DIR/b000042.lease`` (JSON: the owner's job, array task, host, pid, a
random token and the time-to-live). Its *expiry* is its modification time plus ``ttl``: the holder
renews it by touching the file through the descriptor it keeps open (``os.utime(fd)``), so a
renewal can only ever touch the holder's own file, never one that replaced it.

* **Claim**: the owner's record is written to a private temporary file, which is then hard-linked
  into place (``os.link``). ``link`` fails when the name exists, atomically on local disks and on
  NFS v3+/Lustre/GPFS, so of any number of contenders exactly one holds a fresh lease.
* **Take over** an expired lease (its holder was killed, or lost its node): move it aside with
  ``os.rename`` to a name of the contender's own, check that what was moved is the very file that
  was judged expired (same inode, not renewed since), remove it and link the contender's record into
  place. Two contenders cannot both win: the second one's rename either finds nothing or moves the
  winner's fresh file, sees that it is not the expired one and puts it back; the final ``link``
  admits one contender only.
* **Holding** (:meth:`LeaseDir.held`): the file at the lease's name is the holder's own inode and
  token, and more than ``margin`` seconds remain before it expires. A block is committed only after
  this check (and the block's own status check); a holder that lost its lease drops the block.

The guarantee assumes what leases always assume: hosts' clocks agree to well under ``ttl``, and a
holder is never frozen (SIGSTOP) for longer than ``ttl`` between its last check and its commit.
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

DEFAULT_TTL_S = 300.0
TTL_ENV = "VSEKIT_LEASE_TTL_S"
_NAME = re.compile(r"^b(\d+)\.lease$")


def default_ttl() -> float:
    return float(os.environ.get(TTL_ENV, DEFAULT_TTL_S))


def owner_record() -> dict:
    """Who is claiming: SLURM job and array task (when inside one), host and pid."""
    env = os.environ
    job = env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")
    return {"job": job, "task": env.get("SLURM_ARRAY_TASK_ID"), "host": socket.gethostname(),
            "pid": os.getpid()}


@dataclass
class Lease:
    """A lease this process holds: its key, file, open descriptor and token."""

    key: int
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
    """What a lease file says, as any process sees it (for ``vsekit info`` and for takeovers)."""

    key: int
    owner: dict = field(default_factory=dict)
    expires: float = 0.0

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

    def path(self, key: int) -> Path:
        return self.root / f"b{int(key):06d}.lease"

    # --- taking --------------------------------------------------------------------------------
    def _record(self, key: int) -> tuple[Path, int, str]:
        """The owner's record in a private temporary file (kept open); returns (path, fd, token)."""
        token = uuid.uuid4().hex
        tmp = self.root / f".tmp-{token}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        body = dict(self.owner, token=token, ttl=self.ttl, block=int(key), taken=time.time())
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
        return tmp, fd, token

    def claim(self, key: int) -> Lease | None:
        """Take the lease of ``key`` if it is free or expired; None if another task holds it."""
        path = self.path(key)
        tmp, fd, token = self._record(key)
        try:
            for _ in range(4):
                try:
                    os.link(tmp, path)
                    return Lease(key, path, fd, token, self.ttl)
                except FileExistsError:
                    pass
                seen = self._expired_file(path)
                if seen is None:
                    if path.exists():
                        break      # a live lease of another task
                    continue       # released meanwhile: try the link again
                if not self._remove_expired(path, seen, token):
                    break
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    break          # another contender won the takeover
                lease = Lease(key, path, fd, token, self.ttl, stolen_from=seen[2])
                os.utime(fd)       # its expiry counts from now, not from the record's creation
                return lease
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def _expired_file(self, path: Path) -> tuple[os.stat_result, float, dict] | None:
        """(stat, ttl, owner) of the lease at ``path`` if it has expired, else None (live or absent)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        info = _read(path)
        ttl = float(info.get("ttl") or self.ttl)
        if time.time() <= st.st_mtime + ttl:
            return None
        return st, ttl, info

    def _remove_expired(self, path: Path, seen, token: str) -> bool:
        """Move the expired lease ``seen`` aside and delete it; False if what was moved is another."""
        st = seen[0]
        aside = path.with_name(f".{path.name}.takeover-{token}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return True            # gone already: the caller's link decides
        now = os.stat(aside)
        if (now.st_ino, now.st_dev, now.st_mtime_ns) != (st.st_ino, st.st_dev, st.st_mtime_ns):
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)   # a live lease (renewed, or a winner's): put it back
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

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
        mine = os.fstat(lease.fd)
        for attempt in range(5):   # a contender may have it moved aside for an instant
            try:
                st = os.stat(lease.path)
                break
            except FileNotFoundError:
                time.sleep(0.02 * (attempt + 1))
        else:
            return False
        if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
            return False
        if _read(lease.path).get("token") != lease.token:
            return False
        return time.time() + margin < mine.st_mtime + lease.ttl

    def release(self, lease: Lease) -> None:
        """Remove the lease file if it is still this process's own, and close it."""
        if lease.fd < 0:
            return
        aside = lease.path.with_name(f".{lease.path.name}.release-{lease.token}")
        try:
            mine = os.fstat(lease.fd)
            os.rename(lease.path, aside)
            st = os.stat(aside)
            if (st.st_ino, st.st_dev) != (mine.st_ino, mine.st_dev):
                with contextlib.suppress(FileExistsError):
                    os.link(aside, lease.path)  # another's: put it back
            aside.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        finally:
            lease.close()

    # --- looking -------------------------------------------------------------------------------
    def state(self, key: int) -> LeaseState | None:
        path = self.path(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        info = _read(path)
        return LeaseState(key, info, st.st_mtime + float(info.get("ttl") or self.ttl))

    def states(self) -> Iterator[LeaseState]:
        """Every lease file present (live or expired)."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return
        for n in names:
            m = _NAME.match(n)
            if m:
                s = self.state(int(m.group(1)))
                if s is not None:
                    yield s


__all__ = ["DEFAULT_TTL_S", "Lease", "LeaseDir", "LeaseState", "TTL_ENV", "default_ttl", "owner_record"]
