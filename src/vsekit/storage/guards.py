"""The write guards of a store, whatever its backend: one writer per set (:meth:`StoreGuards.writer`),
one over the whole store (:meth:`StoreGuards.store_writer`), and the one check before a block is
written (:meth:`StoreGuards.check_lease`) (docs/store.md, "Write guards: states and transitions")."""

from __future__ import annotations

import contextlib
import uuid
from typing import Iterator

from .leases import free_reason
from .lock import holder, replacing_store, writer_lock
from .objstore import (LeaseHeld, LeaseLost, LeaseObject, SetLease, holder_live, lease_key, lease_valid,
                       require_conditions)

STORE_LEASE = ".store"   # the lease `vsekit split` holds on object storage (lock.STORE_LOCK on disk)


class StoreGuards:
    """The guards of a :class:`~.store.FeatureStore`: lock files on a disk, leases on object storage."""

    def check_lease(self, name: str) -> None:
        """Raise :class:`~.objstore.LeaseLost` unless this process may still commit blocks of ``name``:
        the one check of every guard before a block is written. On a disk: the lock file still holds
        this run's token (a lock another run took over after it expired does not); a process that holds
        no lock and carries no run's token (a library call writing outside any writer) is not checked."""
        if self.objects is None:
            token = self.locks.get(name) or self.lease_token
            if token is None:
                return
            info = holder(self.path, name)
            if not info or info.get("token") != token:
                raise LeaseLost(f"lost the writer lock of feature set {name!r} in {self.path}: another run took "
                                f"it over (this run was paused or cut off past its expiry); not writing")
            return
        if name in self.leases:
            self.leases[name].check()
        elif not lease_valid(self.objects, name, self.lease_token, margin=None):
            raise LeaseLost(f"the run that writes {name!r} in {self.path} no longer holds its lease; "
                            f"not committing")

    @contextlib.contextmanager
    def writer(self, *names: str, stage: str, multi: bool = False) -> Iterator[None]:
        """Hold the one-writer guard of each of ``names``: the lock files on disk, the leases on object
        storage (on a provider that ignores conditional writes every writer is refused unless the user
        says it is the only one: :func:`~.objstore.require_conditions`).
        A name this store holds already is held once (``fne`` holds both its sets, then writes them)."""
        if self.objects is None:
            with writer_lock(self.path, *names, stage=stage):
                taken = [n for n in set(names) if n not in self.locks]
                for n in taken:
                    self.locks[n] = (holder(self.path, n) or {}).get("token")
                try:
                    yield
                finally:
                    for n in taken:
                        self.locks.pop(n, None)
            return
        require_conditions(self.objects, f"{stage} with more than one writer" if multi else stage, multi=multi)
        taken = []
        # one token for the leases this run holds at once (its dask tasks carry it and commit any of its
        # sets); a fresh one for a run that holds none, so tasks of an earlier run never commit for it
        token = next(iter(self.leases.values())).token if self.leases else uuid.uuid4().hex
        try:
            for name in sorted(set(names) - set(self.leases)):   # sorted: two runs never deadlock
                lease = SetLease(self.objects, name, stage, token=token).acquire()
                self.leases[name] = lease
                taken.append(lease)
                self.lease_token = lease.token
            if taken and STORE_LEASE not in names:
                self._check_not_resplit()
            for lease in taken:   # a replacement of a set a killed run left half-done: finished first
                if lease.name != STORE_LEASE:
                    mark = self._finish_remote_replace(lease.name)
                    if mark:
                        self.finished_swaps[lease.name] = mark
            yield
        finally:
            for lease in taken:
                self.leases.pop(lease.name, None)
                lease.release()

    def _check_not_resplit(self) -> None:
        """Refuse to write while `vsekit split` holds this store's lease (object storage; on disk the
        store lock file does this: :func:`vsekit.storage.lock.writer_lock`)."""
        got = LeaseObject(self.objects, lease_key(STORE_LEASE)).read()
        if got is None:
            return
        info, _, expires = got
        if free_reason(info, expires) is None:
            stage = str(info.get("stage", "vsekit split"))
            doing = "replaced" if "ingest" in stage else "re-split"   # ingest --overwrite, or split
            raise LeaseHeld(f"{self.path} is being {doing} by {stage} (pid {info.get('pid')} on "
                            f"{info.get('host')}); wait for it to finish, then run this again")

    @contextlib.contextmanager
    def store_writer(self, stage: str, what: str = "re-split") -> Iterator[None]:
        """Hold the whole store: its guard ``.store`` (a lock file on disk, a lease on object storage),
        refused while any set's guard is live; set writers check it after taking theirs (:meth:`writer`),
        so of two that start at once at least one sees the other."""
        if self.objects is None:
            with replacing_store(self.path, stage=stage):
                yield
            return
        with self.writer(STORE_LEASE, stage=stage):
            for key in self.objects.keys(".vsekit/leases/"):
                name = key.rsplit("/", 1)[-1][:-len(".json")]
                got = self.objects.get_json(key)
                if name == STORE_LEASE or got is None:
                    continue
                info = got[0]
                if holder_live(info) is None:   # a job array's lease counts while its job is queued or running
                    continue
                who = (holder_live(info) if "array_scheduler" in info else
                       f"{info.get('stage', 'vsekit')} (pid {info.get('pid')} on {info.get('host')}); wait for it "
                       f"to finish")
                raise LeaseHeld(f"cannot {what} {self.path}: {name!r} in it is being written by {who}")
            yield
