"""Block leases of a job array on object storage: the counterpart of :class:`.leases.LeaseDir`, one
:class:`~.objstore.ObjectLease` (the object backend of the one lease) per block.

The lease of block K is ONE object, ``PREFIX/b000042.json``: a JSON record of the owner's job, array
task, host, pid, a random token, the time-to-live and ``expires`` (the holder's clock, as the POSIX
lease's expiry is its file's modification time), or ``{"free": true}`` for a released lease. Every
change is a conditional write (:class:`.objstore.Objects`), so of any number of contenders exactly
one wins:

* **claim** a block without a lease object: create-if-absent (``If-None-Match: *``);
* **claim** a free block, or **take over** one whose lease has expired: compare-and-swap on the ETag
  that was read (``If-Match``), so a holder's renewal or another taker in between makes it fail;
* **renew**: compare-and-swap from the holder's last ETag, pushing ``expires`` to ``ttl`` from now;
  it fails once anyone else wrote the object, and the holder then knows it lost the lease;
* **release**: compare-and-swap to a free record from the holder's last ETag ("delete only if still
  ours": a plain delete cannot be made conditional on every provider); a holder that lost the lease
  cannot release the new holder's.

**Holding** (:meth:`ObjectLeaseDir.held`): the holder's last write succeeded (no one wrote the object
since) and more than ``margin`` seconds remain before the expiry it wrote. A block is committed only
after a renewal and this check (and the block's own checks), with the same clock assumption as on a
disk: the hosts' clocks agree to well under ``margin``, and a holder is never frozen longer than that
between its check and its commit record (``tests/test_objstore_array.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from .base import StoreError
from .leases import LeaseState, default_ttl, owner_record
from .objstore import ObjectLease, Objects


class ObjectLeaseDir:
    """The leases of one feature set's blocks: one :class:`~.objstore.ObjectLease` per block under
    ``prefix`` in ``objects``' store (the interface of :class:`.leases.LeaseDir`)."""

    def __init__(self, objects: Objects, prefix: str, ttl: float | None = None, owner: dict | None = None):
        self.objects = objects
        self.prefix = prefix.rstrip("/")
        self.ttl = float(ttl if ttl is not None else default_ttl())
        self.owner = owner if owner is not None else owner_record()

    def object_key(self, key: int) -> str:
        return f"{self.prefix}/b{int(key):06d}.json"

    # --- taking --------------------------------------------------------------------------------
    def claim(self, key: int) -> ObjectLease | None:
        """Take the lease of ``key`` if it is free or expired; None if another task holds it (or
        won it at the same moment)."""
        now = time.time()
        lease = ObjectLease(self.objects, self.object_key(key), dict(self.owner, block=int(key), taken=now), self.ttl)
        if lease.take(now) is not None:
            return None
        lease.key = int(key)   # the block, as a POSIX lease names it
        return lease

    # --- holding -------------------------------------------------------------------------------
    def renew(self, lease: ObjectLease) -> None:
        """Push the expiry of ``lease`` to ``ttl`` seconds from now, if nobody else wrote it since."""
        with lease.lock:
            if lease.etag is None:
                return
            etag = lease.etag
            try:
                lease.swap_body(time.time())
            except StoreError:   # the server did not answer: the lease runs out unless a later renewal works
                lease.etag = etag

    def held(self, lease: ObjectLease, margin: float | None = None) -> bool:
        """Whether ``lease`` is still this process's, with more than ``margin`` seconds left."""
        margin = self.ttl / 4 if margin is None else margin
        with lease.lock:
            return lease.etag is not None and time.time() + margin < lease.expires

    def release(self, lease: ObjectLease) -> None:
        """Mark the block free, only if the lease is still this process's (compare-and-swap)."""
        with lease.lock:
            with contextlib.suppress(StoreError):   # unreachable: the lease simply expires
                lease.free()
            lease.etag = None

    # --- looking -------------------------------------------------------------------------------
    def state(self, key: int) -> LeaseState | None:
        got = self.objects.get_json(self.object_key(key))
        if got is None:
            return None
        info = got[0]
        return LeaseState(int(key), 0, info, float(info.get("expires", 0)))

    def states(self) -> Iterator[LeaseState]:
        """The lease of every block that has one and is not free (live or expired)."""
        for name in self.objects.keys(f"{self.prefix}/"):
            tail = name.rsplit("/", 1)[-1]
            if not (tail.startswith("b") and tail.endswith(".json") and tail[1:-5].isdigit()):
                continue
            s = self.state(int(tail[1:-5]))
            if s is not None and not s.free:
                yield s


__all__ = ["ObjectLease", "ObjectLeaseDir"]
