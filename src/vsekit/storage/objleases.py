"""Block leases of a job array on object storage: the one lease (:class:`.leases.Lease`) over one
object per block, ``PREFIX/b000042.json`` (:class:`.objstore.LeaseObject`), as
:func:`.leases.LeaseDir` is over files; its transitions: docs/store.md, "Write guards: states and
transitions" (``tests/test_objstore_array.py``).
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
