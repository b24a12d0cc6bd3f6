"""Block leases of a job array on object storage: the one lease (:class:`.leases.Lease`) over one
object per block (:class:`.objstore.LeaseObject`), as :func:`.leases.LeaseDir` is over files.

The lease of block K is ONE object, ``PREFIX/b000042.json``: a JSON record of the owner's job, array
task, host, pid, a random token, the time-to-live and ``expires`` (the holder's clock, as the POSIX
lease's expiry is its file's modification time), or ``{"free": true}`` for a released lease. Every
change is a conditional write (:class:`.objstore.Objects`), so of any number of contenders exactly
one wins: a claim creates it if absent, or takes a free or expired one over by compare-and-swap on
the ETag read; a renewal and a release (to a free record) compare-and-swap from the holder's last
ETag, so a holder that lost the lease cannot renew or release the new holder's. A block is committed
only after a renewal and :meth:`~.leases.BlockLeases.held`, with the same clock assumption as on a
disk (``tests/test_objstore_array.py``).
"""

from __future__ import annotations

import time

from .leases import BlockLeases
from .objstore import LeaseObject, Objects


def ObjectLeaseDir(objects: Objects, prefix: str, ttl: float | None = None, owner: dict | None = None) -> BlockLeases:
    """The leases of one feature set's blocks under ``prefix`` in ``objects``' store."""
    prefix = prefix.rstrip("/")

    def keys() -> list[int]:
        tails = (k.rsplit("/", 1)[-1] for k in objects.keys(f"{prefix}/"))
        return [int(t[1:-5]) for t in tails if t.startswith("b") and t.endswith(".json") and t[1:-5].isdigit()]

    return BlockLeases(lambda key: LeaseObject(objects, f"{prefix}/b{int(key):06d}.json"), keys, ttl, owner,
                       clock=time)


__all__ = ["ObjectLeaseDir"]
