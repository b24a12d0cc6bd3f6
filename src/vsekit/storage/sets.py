"""How a store keeps its feature sets and tokens: one small interface, :class:`SetStorage`, with two
implementations chosen once, where the store is opened (:class:`~.store.FeatureStore`'s ``sets``):
:class:`DiskSets` on a POSIX disk (lock files, atomic renames, checksums in ``blocksums``) and
:class:`~.objsets.ObjectSets` on object storage (leases, create-if-absent commit records, marked,
lease-checked copies). Callers say what they want done (take the writer guard, commit a block's
records, swap a built set in, verify, repair, delete) and never ask which one they have; where the
two protocols differ, the difference lives in the two classes (docs/store.md, "One swap").
"""

from __future__ import annotations

import abc
import contextlib
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import zarr

from . import integrity
from .base import STAGED, STORE_GUARD, Block, LeaseHeld, read_generation
from .faults import point
from .leases import JointLease, Lease, holder_words
from .lock import LockFile, describe, hand_over, holder, live, lock_path, writer_lock
from .objcommit import swap_dir
from .objstore import LeaseLost

if TYPE_CHECKING:  # pragma: no cover
    from .store import FeatureSet, FeatureStore


class SetStorage(abc.ABC):
    """What a :class:`~.store.FeatureStore` asks of its backend (see the module's docstring); an
    implementation that leaves out an abstract method cannot be made (no method silently returns None)."""

    remote = False
    guard = "writer lock"   # what a writer holds, in messages
    chunk_word = "file"     # what a chunk is, in messages

    def __init__(self, store: "FeatureStore"):
        self.store = store

    def options(self) -> dict[str, str]:
        """The storage options a task in another process opens the store with (none on a disk)."""
        return {}

    def check_cluster(self, cluster: Any, what: str, arrays: bool = False) -> Any:
        """``cluster`` as ``what`` may run on it here (object storage refuses clusters whose workers
        cannot reach the store: :meth:`.objsets.ObjectSets.check_cluster`)."""
        return cluster

    def task_path(self) -> str:
        """Where a task in another process opens the store (an absolute path, or the URL)."""
        return str(Path(self.store.path).resolve())

    # the writer guards (docs/store.md, "Write guards: states and transitions") -----------------------
    @abc.abstractmethod
    def holds(self, name: str, token: str | None) -> bool:
        """Whether the run whose token is ``token`` still holds ``name``'s guard (read, not renewed)."""

    @abc.abstractmethod
    def token(self, name: str) -> str | None:
        """The token of the guard of ``name`` this run holds (what its tasks commit under)."""

    def check_lease(self, name: str) -> None:
        """Raise :class:`~.objstore.LeaseLost` unless this process may still commit blocks of ``name``:
        the lease it holds, renewed now (object storage), or the guard still holding this run's token
        (a lock another run took over after it expired does not; a dask task checks its driver's).
        On a disk a process that holds no lock and carries no token (a library call writing outside
        any writer) is not checked."""
        held = self.store.leases.get(name)
        if held is not None:
            return held.check()
        if not self.holds(name, self.store.locks.get(name) or self.store.lease_token):
            raise LeaseLost(f"lost the {self.guard} of feature set {name!r} in {self.store.path}: another run "
                            f"took it over (this run was paused or cut off past its expiry); not writing")

    @abc.abstractmethod
    def writer(self, names: tuple[str, ...], stage: str, multi: bool) -> contextlib.AbstractContextManager:
        """Hold the one-writer guard of each of ``names``."""

    @abc.abstractmethod
    def live(self, name: str) -> tuple[dict, float] | None:
        """The record of ``name``'s guard and its expiry while its holder keeps it (the one takeover
        rule), else None."""

    @abc.abstractmethod
    def guard_names(self) -> list[str]:
        """The names of every guard with a record in this store, live or not."""

    @contextlib.contextmanager
    def store_writer(self, stage: str, what: str) -> Iterator[None]:
        """Hold the whole store's guard, refused while any set's guard is live. Set writers check it
        after taking theirs (:meth:`refuse_if_store_held`) and this checks theirs after taking it, so
        of two that start at once at least one sees the other."""
        with self.writer((STORE_GUARD,), stage, False):
            for name in self.guard_names():
                held = None if name == STORE_GUARD else self.live(name)
                if held is not None:
                    info, expires = held
                    array = info.get("array_job") or info.get("slurm_array") or "array_scheduler" in info
                    who = holder_words(info, expires) if array else f"{describe(info)}; wait for it to finish"
                    raise LeaseHeld(f"cannot {what} {self.store.path}: {name!r} in it is being written by {who}")
            yield

    def refuse_if_store_held(self) -> None:
        """Refuse to write while another run (not this store's holder) holds the whole store's guard
        (a split or a replacement)."""
        held = self.live(STORE_GUARD)
        if held and STORE_GUARD not in self.store.locks and STORE_GUARD not in self.store.leases:
            doing = "replaced" if "ingest" in str(held[0].get("stage")) else "re-split"
            raise LeaseHeld(f"{self.store.path} is being {doing} by {describe(held[0])}; wait for it to finish, "
                            f"then run this again")

    @abc.abstractmethod
    def hand_over(self, name: str, token: str, extra: dict) -> Callable[[], None]:
        """Hand ``name``'s guard (held by this run) to a job array: its ``token`` and ``extra`` (job id,
        scheduler, stage); returns what hands it back (a refused submission)."""

    @abc.abstractmethod
    def join(self, name: str, token: str, ttl: float) -> Lease:
        """``name``'s guard as a job array's task holds it with its siblings, under the array's
        ``token``: ``renew()`` and ``check()`` raise :class:`~.objstore.LeaseLost` once it is not theirs."""

    # a set's life ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def generation(self, name: str) -> str | None:
        """The generation of set ``name`` as its metadata says now (``"absent"``: no such set)."""

    @abc.abstractmethod
    def staged(self, name: str) -> bool:
        """Whether the hidden set ``name`` (built by a writer, not yet swapped in) is there."""

    @abc.abstractmethod
    def create(self, name: str, spec: tuple, *, replace: bool, beside: bool) -> "FeatureSet":
        """A new set ``name`` built from ``spec`` (:meth:`~.store.FeatureStore._build`'s arguments);
        ``replace``: a set of that name exists and goes; ``beside``: keep it until :meth:`swap`."""

    @abc.abstractmethod
    def swap(self, name: str, staging: str) -> None:
        """Put the complete hidden set ``staging`` in place as ``name`` (the old one goes)."""

    @abc.abstractmethod
    def discard(self, fs: "FeatureSet") -> None:
        """Drop the staged set ``fs`` (never one a swap under way needs)."""

    @abc.abstractmethod
    def remove_leftovers(self, name: str) -> list[str]:
        """Remove the hidden sets of ``name`` killed runs left (under ``name``'s guard)."""

    @contextlib.contextmanager
    def building(self, name: str, row_shape: Any, dtype: Any, overwrite: bool, **create_kw: Any) -> Iterator[Any]:
        """A set built under ``name``'s guard and a hidden name (``.NAME.partial-*``, its blocks committed
        under NAME's guard), then swapped in (:meth:`swap`) when the block succeeds; a failure before
        the swap drops it (ingest)."""
        store = self.store
        with store.writer(name, stage="vsekit ingest"):
            # a set a killed ingest had built new and this run's lease published is made again, not refused
            if not store.finished_swaps.get(name, {}).get("new"):
                store.refuse_existing(name, overwrite)
            self.remove_leftovers(name)
            staging = f".{name}.partial-{uuid.uuid4().hex[:8]}"
            fs = store.create_features(staging, row_shape, dtype, **create_kw)
            try:
                yield fs
                self.swap(name, staging)
                fs.name, fs.target, fs.group = name, name, store.root[f"features/{name}"]
            except BaseException:
                self.discard(fs)
                raise

    # a block's records -----------------------------------------------------------------------------
    @abc.abstractmethod
    def may_write(self, fs: "FeatureSet", block: Block) -> bool:
        """Before a block's chunks are written: False when they must not be (committed already)."""

    @abc.abstractmethod
    def commit_block(self, fs: "FeatureSet", block: Block, status: Any) -> bool:
        """Record ``block`` (its chunks are written) as committed; False when another writer did first."""

    @abc.abstractmethod
    def committed(self, fs: "FeatureSet", block: Block) -> bool:
        """Whether ``block`` is committed and whole (a dask task asks before computing and writing)."""

    def reconcile(self, fs: "FeatureSet") -> int:
        """Restore the status of committed blocks whose status was not written; returns how many."""
        return 0

    def reopen(self, fs: "FeatureSet", indices: list[int]) -> None:
        """Before blocks with committed rows are written again (``--retry-failed``): on a disk nothing
        to do (a block's checksums are recorded anew when it is written)."""

    @abc.abstractmethod
    def recorded(self, fs: "FeatureSet", etags: dict | None = None) -> Callable[[int], Any]:
        """Block index → the (CRC, size) recorded of each of ``fs``'s checksummed arrays, or why the
        block has no record (:func:`.integrity.verify`, :class:`.integrity.BlockCheck`); ``etags``:
        filled with the records' versions where a repair must not void a later one."""

    @abc.abstractmethod
    def chunk_sum(self, fs: "FeatureSet", array: str, index: int, crc: bool) -> tuple[int, int]:
        """(CRC-32, size) of chunk ``index`` of ``array`` as stored now (``crc``: else 0)."""

    @abc.abstractmethod
    def repair(self, fs: "FeatureSet", report: "integrity.Report") -> int:
        """Mark the damaged blocks of ``report`` pending (:func:`.integrity.repair`)."""

    @abc.abstractmethod
    def replace_array(self, key: str, values: Any) -> None:
        """Replace the whole small array ``key`` of the store (``images/split``) by ``values``."""

    def swaps(self) -> tuple[bool, list[str]]:
        """Swaps a killed run left to finish (object storage: its marks; a disk has none)."""
        return False, []

    # tokens ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def swap_group(self, staging: str, dst: str, guard: str, fault: str) -> None:
        """Replace the group ``dst`` (``tokens``) by the complete group ``staging`` under ``guard``."""

    @abc.abstractmethod
    def finish_group_swap(self, dst: str, guard: str, fault: str) -> None:
        """Finish a swap of ``dst`` a killed run left (before anything else is staged)."""


class DiskSets(SetStorage):
    """Feature sets in folders: lock files guard them, a set is built under a hidden name and renamed
    into place, a block is committed by its checksums and then its status."""

    @property
    def path(self) -> Path:
        return Path(self.store.path)

    def holds(self, name: str, token: str | None) -> bool:
        """The lock file of ``name`` is live and holds ``token`` (no token: nothing to check)."""
        info = holder(self.path, name) if token is not None else {"token": None}
        return bool(info) and info.get("token") == token

    def token(self, name: str) -> str | None:
        return (holder(self.path, name) or {}).get("token")

    @contextlib.contextmanager
    def writer(self, names: tuple[str, ...], stage: str, multi: bool) -> Iterator[None]:
        locks = self.store.locks
        check = (lambda: None) if STORE_GUARD in names else self.refuse_if_store_held
        with writer_lock(self.path, *names, stage=stage, check=check):
            taken = [n for n in set(names) if n not in locks]
            for n in taken:
                locks[n] = self.token(n)
            try:
                yield
            finally:
                for n in taken:
                    locks.pop(n, None)

    def live(self, name: str) -> tuple[dict, float] | None:
        return live(lock_path(self.path, name))

    def guard_names(self) -> list[str]:
        return sorted(p.name[:-len(".lock")] for p in lock_path(self.path, "x").parent.glob("*.lock"))

    def hand_over(self, name: str, token: str, extra: dict) -> Callable[[], None]:
        return hand_over(self.path, name, token, extra)

    def join(self, name: str, token: str, ttl: float) -> Lease:
        return JointLease(LockFile(lock_path(self.path, name)), f"the writer lock of {name!r} in {self.path}",
                          token, ttl)

    def generation(self, name: str) -> str | None:
        return read_generation(self.path, name)

    def staged(self, name: str) -> bool:
        return STAGED in name and (self.path / "features" / name / "zarr.json").exists()

    def create(self, name: str, spec: tuple, *, replace: bool, beside: bool) -> "FeatureSet":
        later = beside and replace
        staging = f".{name}.{STAGED if later else 'creating-'}{uuid.uuid4().hex[:8]}"
        g = self.store.root.require_group("features").create_group(staging)
        try:
            self.store._build(g, staging, *spec)
        except BaseException:
            shutil.rmtree(self.path / "features" / staging, ignore_errors=True)
            raise
        if later:
            return self.store.feature_set(staging, target=name)
        point("create_features:rename")
        self.swap(name, staging)
        return self.store.feature_set(name)

    def swap(self, name: str, staging: str) -> None:
        """Rename the complete hidden set ``staging`` to ``name``; an old ``name`` is moved aside first."""
        base = self.path / "features"
        swap_dir(base / staging, base / name, step=lambda: point("create_features:swap"))

    def discard(self, fs: "FeatureSet") -> None:
        shutil.rmtree(self.path / "features" / fs.name, ignore_errors=True)

    def remove_leftovers(self, name: str) -> list[str]:
        base = self.path / "features"
        if not base.is_dir():
            return []
        gone = []
        for p in base.iterdir():
            if p.name.startswith((f".{name}.creating-", f".{name}.old-", f".{name}.partial-",
                                  f".{name}.{STAGED}")):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
        return gone

    def may_write(self, fs: "FeatureSet", block: Block) -> bool:
        self.check_lease(fs.target)   # a lock another run took over: nothing written
        return True

    def commit_block(self, fs: "FeatureSet", block: Block, status: Any) -> bool:
        self.check_lease(fs.target)   # again right before the commit (checksums, then status)
        point("write_block:sums")
        integrity.record(fs, block)
        return True

    committed = staticmethod(integrity.sums_committed)

    def recorded(self, fs: "FeatureSet", etags: dict | None = None) -> Callable[[int], Any]:
        return integrity.recorded_sums(fs)

    chunk_sum = staticmethod(integrity.file_sum)
    repair = staticmethod(integrity.repair_sums)

    def replace_array(self, key: str, values: Any) -> None:
        """Written beside the old one and renamed into place: a reader sees the old array or the new
        one, never a half-written one."""
        tag = uuid.uuid4().hex[:8]
        staged = self.path / f".{key.replace('/', '-')}-next-{tag}"
        zarr.create_array(str(staged), shape=values.shape, dtype=values.dtype,
                          chunks=tuple(self.store.root[key].chunks), zarr_format=3)[:] = values
        swap_dir(staged, self.path / key, trash=self.path / f".{key.replace('/', '-')}-old-{tag}")
        self.store.root = zarr.open_group(str(self.path), mode="r+", zarr_format=3)

    def swap_group(self, staging: str, dst: str, guard: str, fault: str) -> None:
        swap_dir(self.path / staging, self.path / dst, trash=self.path / f".{dst}-old-{uuid.uuid4().hex[:8]}")

    def finish_group_swap(self, dst: str, guard: str, fault: str) -> None:
        for old in self.path.glob(f".{dst}-old-*"):   # a killed swap's old group, moved aside
            shutil.rmtree(old, ignore_errors=True)
