"""Block leases of a job array on object storage: the counterpart of :class:`.leases.LeaseDir`.

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
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

from .base import StoreError
from .leases import LeaseState, default_ttl, free_reason, owner_record
from .objstore import Objects, dumps


@dataclass
class ObjectLease:
    """A lease this process holds on object storage: its block, token, last ETag and expiry."""

    key: int
    token: str
    etag: str | None
    expires: float
    ttl: float
    stolen_from: dict | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


class ObjectLeaseDir:
    """The leases of one feature set's blocks: objects under ``prefix`` in ``objects``' store."""

    def __init__(self, objects: Objects, prefix: str, ttl: float | None = None, owner: dict | None = None):
        self.objects = objects
        self.prefix = prefix.rstrip("/")
        self.ttl = float(ttl if ttl is not None else default_ttl())
        self.owner = owner if owner is not None else owner_record()

    def object_key(self, key: int) -> str:
        return f"{self.prefix}/b{int(key):06d}.json"

    def _body(self, key: int, token: str, expires: float) -> bytes:
        return dumps(dict(self.owner, token=token, ttl=self.ttl, block=int(key), taken=time.time(),
                          expires=expires))

    # --- taking --------------------------------------------------------------------------------
    def claim(self, key: int) -> ObjectLease | None:
        """Take the lease of ``key`` if it is free or expired; None if another task holds it (or
        won it at the same moment)."""
        name = self.object_key(key)
        got = self.objects.get_json(name)
        token = uuid.uuid4().hex
        expires = time.time() + self.ttl
        if got is None:
            etag, stolen = self.objects.create(name, self._body(key, token, expires)), None
        else:
            info, seen = got
            if free_reason(info, float(info.get("expires", 0)), time.time()) is None:
                return None
            etag = self.objects.swap(name, self._body(key, token, expires), seen) if seen else None
            stolen = None if info.get("free") else info
        if etag is None:
            return None
        return ObjectLease(int(key), token, etag, expires, self.ttl, stolen_from=stolen)

    # --- holding -------------------------------------------------------------------------------
    def renew(self, lease: ObjectLease) -> None:
        """Push the expiry of ``lease`` to ``ttl`` seconds from now, if nobody else wrote it since."""
        with lease.lock:
            if lease.etag is None:
                return
            expires = time.time() + lease.ttl
            try:
                etag = self.objects.swap(self.object_key(lease.key), self._body(lease.key, lease.token, expires),
                                         lease.etag)
            except StoreError:   # the server did not answer: the lease runs out unless a later renewal works
                return
            if etag is None:
                lease.etag = None       # taken over after it expired (or released): lost for good
            else:
                lease.etag, lease.expires = etag, expires

    def held(self, lease: ObjectLease, margin: float | None = None) -> bool:
        """Whether ``lease`` is still this process's, with more than ``margin`` seconds left."""
        margin = self.ttl / 4 if margin is None else margin
        with lease.lock:
            return lease.etag is not None and time.time() + margin < lease.expires

    def release(self, lease: ObjectLease) -> None:
        """Mark the block free, only if the lease is still this process's (compare-and-swap)."""
        with lease.lock:
            if lease.etag is None:
                return
            with contextlib.suppress(StoreError):   # unreachable: the lease simply expires
                self.objects.swap(self.object_key(lease.key), dumps({"free": True, "released_by": lease.token}),
                                  lease.etag)
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
