"""The vsekit Zarr v3 store: images, captions, tokens and feature sets with provenance.

Layout (docs/store.md, "Layout")::

    /                      attrs: format_version, dataset, source_files, image_root, codes
    images/id|path|split   (N,)
    captions/text|image    (M,)
    tokens/ids|offsets     ragged token arrays (written by vsekit.tokenize)
    features/<name>/data   (N, ...)   one feature set per extraction or derivation
    features/<name>/status (N,) uint8 0 pending, 1 done, 2 failed

A feature set is written in *row blocks* aligned to the chunks of its arrays: a block is the unit of
work, distribution and resume. A block's data is written before its checksums and its status, so a
block whose status rows are all non-zero is complete, and a rerun skips it. Two writers never touch
the same chunk. A new set is built complete (arrays and attrs) under a hidden name and renamed into
place, so a killed creation leaves nothing that looks like a set (see docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import zarr
import zarr.storage

from ..version import __version__
from . import integrity
from .base import (DONE, FAILED, PENDING, STAGED, STATUS_NAMES, Block, FormatVersionError,  # noqa: F401
                   ProvenanceError, StoreError, no_feature_set, not_a_store, read_generation)
from .faults import point
from .fserrors import names_set_path, names_store_path

FORMAT_VERSION = 1
SPLITS: tuple[str, ...] = ("train", "val", "test", "restval")
SPLIT_CODES: dict[str, int] = {name: i for i, name in enumerate(SPLITS)}

STRING_CHUNK = 65536


def config_hash(config: Mapping[str, Any]) -> str:
    """A short, stable hash of a JSON-serialisable configuration."""
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: attrs that record when or by what a set was made, not its settings
_NOT_SETTINGS = frozenset({"code_version", "config_hash", "generation", "parent_generation", "created",
                           "finished", "complete", "stats_ready", "lock_token"})


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The settings ``new`` asks for that ``old`` has otherwise, as ``crops 10 → 5`` (``(none)``: unset)."""
    out = []
    for key in sorted(new):   # the settings asked for; the old set's attrs also hold what its writers added
        if key in _NOT_SETTINGS:
            continue
        a, b = _jsonable(old.get(key)), _jsonable(new.get(key))
        if a != b:
            out.append(f"{key} {_show(a)} → {_show(b)}")
    return out


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def row_chunk_for(row_bytes: int, target_bytes: int = 16 << 20, lo: int = 16, hi: int = 4096) -> int:
    """Rows per chunk so that a chunk holds about ``target_bytes`` (clamped to [lo, hi])."""
    rows = max(1, target_bytes // max(1, row_bytes))
    return int(min(hi, max(lo, rows)))


def split_code(split: str | int) -> int:
    if isinstance(split, (int, np.integer)):
        if not 0 <= int(split) < len(SPLITS):
            raise ValueError(f"unknown split code {split}; valid: {SPLIT_CODES}")
        return int(split)
    try:
        return SPLIT_CODES[str(split)]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; valid choices: {', '.join(SPLITS)}") from None


def _jsonable(value: Any) -> Any:
    """Make attrs JSON-safe (numpy scalars and arrays, tuples, paths)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value


class FeatureSet:
    """One feature set: ``data`` (N, ...) and ``status`` (N,), plus provenance in attrs."""

    def __init__(self, store: "FeatureStore", name: str, target: str | None = None):
        self.store = store
        self.name = name
        # the name it takes when committed (see FeatureStore.commit); on object storage a task that opens a
        # staged set by its hidden name commits its blocks under the lease of the set it will replace
        self.target = target or (owner_of(name) if store.remote else name)
        self.group = store.root[f"features/{name}"]

    @property
    def staged(self) -> bool:
        """True for a set built beside the one it will replace (``--overwrite``), not yet committed."""
        return self.target != self.name

    @property
    def generation(self) -> str | None:
        """The id made when this set was created; a set made again (``--overwrite``) has a new one."""
        if self.store.objects is not None:
            got = self.store.objects.get_json(f"features/{self.name}/zarr.json")
            return "absent" if got is None else (got[0].get("attributes") or {}).get("generation")
        return read_generation(self.store.path, self.name)

    # arrays ---------------------------------------------------------------------------------------
    @property
    def data(self) -> zarr.Array:
        return self.group["data"]

    @property
    def status(self) -> zarr.Array:
        return self.group["status"]

    def array(self, name: str) -> zarr.Array:
        """An auxiliary array of this set (``mean``, ``boxes``, ``count``...)."""
        try:
            return self.group[name]
        except KeyError:
            raise StoreError(f"feature set {self.name!r} has no array {name!r}; it has: "
                             f"{', '.join(sorted(self.group.array_keys()))}") from None

    def has_array(self, name: str) -> bool:
        return name in set(self.group.array_keys())

    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    @names_set_path
    def update_attrs(self, **values: Any) -> None:
        self.group.attrs.update(_jsonable(values))

    @property
    def n_rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def chunk_rows(self) -> int:
        return int(self.group.attrs.get("block_rows", self.data.chunks[0]))

    # blocks ---------------------------------------------------------------------------------------
    def blocks(self) -> list[Block]:
        step, n = self.chunk_rows, self.n_rows
        return [Block(i, s, min(s + step, n)) for i, s in enumerate(range(0, n, step))]

    def block_done(self, block: Block) -> bool:
        return bool(np.all(self.status[block.start:block.stop] != PENDING))

    def status_values(self) -> np.ndarray:
        """All status codes; a damaged status chunk is a StoreError naming the repair command."""
        try:
            return np.asarray(self.status[:])
        except Exception as exc:  # zarr's codec error on a truncated or garbled chunk
            raise StoreError(
                f"feature set {self.name!r} in {self.store.path}: a status chunk is unreadable "
                f"({type(exc).__name__}: {exc}); {integrity.repair_command(self.store.path, self.name)}"
            ) from None

    def pending_blocks(self) -> list[Block]:
        status = self.status_values()
        return [b for b in self.blocks() if np.any(status[b.start:b.stop] == PENDING)]

    @names_set_path
    def write_block(self, block: Block | int, data: np.ndarray | None = None,
                    status: np.ndarray | None = None, **arrays: np.ndarray) -> bool:
        """Write one row block: its data and auxiliary arrays first, then its status.

        ``status`` defaults to all done. The status is written last so that a block interrupted
        half-way is still pending on the next run. False (nothing written) on object storage when
        another writer committed the block first; True otherwise.
        """
        if isinstance(block, int):
            block = self.blocks()[block]
        if self.store.objects is not None:
            from . import objcommit

            if objcommit.committed(self, block):   # committed already: its chunks are never written again
                return False
        else:
            self.store.check_lease(self.target)   # a lock another run took over: nothing written
        for name, values in arrays.items():
            point("write_block:aux")
            self.array(name)[block.start:block.stop] = values
        if data is not None:
            point("write_block:data")
            self.data[block.start:block.stop] = data
        if status is None:
            status = np.full(len(block), DONE, dtype=np.uint8)
        if self.store.objects is not None:   # object storage: the record commits it (storage/objcommit.py)
            from . import objcommit

            if not objcommit.write_record(self, block, status):
                return False   # committed already by another writer: its status is restored from its record
        else:
            self.store.check_lease(self.target)   # again right before the commit (checksums, then status)
            point("write_block:sums")
            integrity.record(self, block)
        point("write_block:status")
        self.status[block.start:block.stop] = np.asarray(status, dtype=np.uint8)
        return True

    def counts(self) -> dict[str, int]:
        status = self.status_values()
        return {name: int(np.sum(status == code)) for code, name in STATUS_NAMES.items()}

    def is_complete(self) -> bool:
        return self.counts()["pending"] == 0

    # errors (written by the single driver process, never by parallel block writers) ---------------
    @names_set_path
    def record_errors(self, errors: Mapping[int, str]) -> None:
        if not errors:
            return
        point("record_errors")
        current = dict(self.group.attrs.get("errors", {}))
        current.update({str(int(k)): str(v) for k, v in errors.items()})
        self.group.attrs["errors"] = current

    def clear_errors(self, rows: Iterable[int]) -> None:
        """Forget the failure reasons of ``rows`` (they are being tried again)."""
        current = dict(self.group.attrs.get("errors", {}))
        for r in rows:
            current.pop(str(int(r)), None)
        self.group.attrs["errors"] = current

    def errors(self) -> dict[int, str]:
        return {int(k): v for k, v in self.group.attrs.get("errors", {}).items()}

    # provenance -----------------------------------------------------------------------------------
    def check(self, expect: Mapping[str, Any] | None = None, *, complete: bool = False) -> "FeatureSet":
        """Refuse this set unless its attrs match ``expect`` (and, optionally, every row is done)."""
        attrs = self.attrs
        for key, want in (expect or {}).items():
            have = attrs.get(key)
            ok = have in want if isinstance(want, (set, frozenset)) else have == _jsonable(want)
            if not ok:
                raise ProvenanceError(
                    f"feature set {self.name!r} in {self.store.path} has {key}={have!r}, "
                    f"but this command expects {key}={want!r}")
        if complete:
            c = self.counts()
            if c["pending"]:
                raise ProvenanceError(
                    f"feature set {self.name!r} is incomplete: {c['pending']} of {self.n_rows} rows "
                    f"are pending; rerun the command that makes it to finish it")
        return self

    def lineage(self) -> list[str]:
        """This set's name followed by its ancestors' names."""
        names, attrs = [self.name], self.attrs
        while attrs.get("parent"):
            names.append(attrs["parent"])
            attrs = self.store.features(attrs["parent"]).attrs if self.store.has_features(attrs["parent"]) else {}
        return names

    def __repr__(self) -> str:
        return f"FeatureSet({self.name!r}, shape={self.shape}, dtype={self.data.dtype})"


def default_compressors(row_shape: Sequence[int], dtype: Any, kind: str | None = "global") -> Any:
    """The codec of a new feature set's ``data``: None (raw) for global float32 vectors, else zstd.

    Global features (one float32 vector per image) are what the trainer reads every epoch, and
    dense CNN features barely compress (zstd saves ~8% on pooled ResNet features) while decoding
    them costs several times more than reading them: raw chunks are read straight into the
    loader's window buffer (``vsekit.train.data``). Grids and regions (tens of GB, sparse after
    ReLU) and FNE sets (read once by each post-processing stage; the codes compress 10x) keep
    zarr's default zstd, which does pay there.
    """
    if kind == "global" and len(tuple(row_shape)) == 1 and np.dtype(dtype) == np.float32:
        return None
    return "auto"


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(path: str | os.PathLike) -> Path:
    """The filesystem path of a store, or one clear refusal for a URL vsekit cannot serve.

    ``file://`` URLs name a local path. Any other scheme is refused: taken as a path it would create a
    folder named ``s3:`` in the working directory
    (``tests/test_store.py::test_a_store_url_vsekit_cannot_serve_is_refused_and_creates_nothing``).
    Object-store URLs (``s3://``, ``gs://``, ``az://``, ``memory://``) are opened by
    :class:`FeatureStore` itself, by the commands that serve them; the others
    refuse them here, naming what does.
    """
    text = os.fspath(path)
    match = _URL.match(text) if isinstance(text, str) else None
    if match is None:
        return Path(text)
    if match.group(1).lower() == "file":
        return Path(text[len(match.group(0)):] or "/")
    from .objstore import SERVED_BY, is_object_url, public_url

    if is_object_url(text):
        raise StoreError(f"--store {public_url(text)}: this command does not serve object-store stores yet; "
                         f"{match.group(1)}:// stores are served by {SERVED_BY} (issue 35)")
    raise StoreError(f"--store {text}: {match.group(1)}:// stores are not supported by this vsekit; a store is a "
                     f"local or shared-filesystem path, or s3://, gs://, az:// object storage")



class FeatureStore:
    """A vsekit store: one Zarr v3 group per dataset."""

    def __init__(self, root: zarr.Group, path: str | os.PathLike, objects: Any = None):
        self.root = root
        self.objects = objects   # an objstore.Objects for an object-store URL, else None
        self.path = Path(path) if objects is None else objects.url
        self.leases: dict[str, Any] = {}   # set name → the SetLease this process holds (object storage)
        self.locks: dict[str, str] = {}    # set name → the token of the lock file this process holds (disk)
        self.lease_token: str | None = None   # the driver's lease token a dask task writes under
        self._new_store_leases: Any = None   # while an ingest builds this store on object storage
        self.finished_swaps: dict[str, dict] = {}   # set name → the mark of a killed run's swap this one finished

    @property
    def remote(self) -> bool:
        """True for a store on object storage (``s3://``...): ``path`` is then its URL (a str)."""
        return self.objects is not None

    def check_lease(self, name: str) -> None:
        """Raise :class:`~.objstore.LeaseLost` unless this process may still commit blocks of ``name``:
        the one check of every guard before a block is written. On a disk: the lock file still holds
        this run's token (a lock another run took over after it expired does not); a process that holds
        no lock and carries no run's token (a library call writing outside any writer) is not checked."""
        from .objstore import LeaseLost, lease_valid

        if self.objects is None:
            token = self.locks.get(name) or self.lease_token
            if token is None:
                return
            from .lock import holder

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
            from .lock import holder, writer_lock

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
        from .objstore import SetLease, require_conditions

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
        from .leases import free_reason
        from .objstore import LeaseHeld, lease_key

        got = self.objects.get_json(lease_key(STORE_LEASE))
        if got is None:
            return
        info = got[0]
        if free_reason(info, float(info.get("expires", 0))) is None:
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
            from .lock import replacing_store

            with replacing_store(self.path, stage=stage):
                yield
            return
        from .objstore import LeaseHeld, holder_live

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

    # opening --------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, *, dataset: str, image_root: str | os.PathLike = "",
               source_files: Sequence[str] = (), overwrite: bool = False,
               storage_options: Any = None) -> "FeatureStore":
        from .objstore import is_object_url

        if is_object_url(os.fspath(path)):
            return cls._create_remote(os.fspath(path), storage_options, dataset=dataset, image_root=image_root,
                                      source_files=source_files, overwrite=overwrite)
        path = local_path(path)
        if path.exists() and not overwrite:
            raise StoreError(f"{path} already exists; pass --overwrite to replace it")
        root = zarr.open_group(str(path), mode="w", zarr_format=3)
        root.attrs.update(_jsonable({
            "vsekit_format": FORMAT_VERSION,
            "vsekit_version": __version__,
            "dataset": dataset,
            "image_root": str(Path(image_root).resolve()) if image_root else "",
            "source_files": list(source_files),
            "codes": SPLIT_CODES,
            "complete": False,
        }))
        return cls(root, path)

    @classmethod
    def _create_remote(cls, url: str, storage_options: Any, *, dataset: str, image_root: Any,
                       source_files: Sequence[str], overwrite: bool) -> "FeatureStore":
        """A new store at an object-store URL: its root ``zarr.json`` created with create-if-absent (one
        ingest per URL), ``complete: false`` until the ingest finishes (:meth:`building`)."""
        from .objcommit import group_meta
        from .objstore import Objects, parse_options

        from .objstore import require_conditions

        objects = Objects(url, parse_options(storage_options))
        refuse_if_store_replaced(objects)
        require_conditions(objects, "vsekit ingest")   # one ingest per URL rests on create-if-absent
        if overwrite and objects.get("zarr.json") is not None:   # only ingest replaces one (building)
            raise StoreError(f"--store {objects.url}: a store on object storage is replaced by `vsekit ingest "
                             f"... --overwrite` only")
        attrs = _jsonable({"vsekit_format": FORMAT_VERSION, "vsekit_version": __version__, "dataset": dataset,
                           "image_root": str(Path(image_root).resolve()) if image_root else "",
                           "source_files": list(source_files), "codes": SPLIT_CODES, "complete": False})
        if objects.create("zarr.json", group_meta(attrs)) is None:
            raise StoreError(f"{objects.url} already exists (it has a zarr.json); ingest into a new URL, or "
                             f"delete its objects first")
        root = zarr.open_group(objects.zarr_store(), mode="r+", zarr_format=3)
        return cls(root, objects.url, objects)

    @classmethod
    def _open_remote(cls, url: str, mode: str, storage_options: Any) -> "FeatureStore":
        from .objstore import Objects, parse_options

        objects = Objects(url, parse_options(storage_options))
        got = objects.get_json("zarr.json")
        if got is None:   # a store's objects are deleted only after its zarr.json (finish_store_replace)
            refuse_if_store_replaced(objects)
        if got is None:
            raise StoreError(not_a_store(objects.url))
        attrs = got[0].get("attributes") or {}
        if attrs.get("vsekit_format") is None:
            raise StoreError(f"{objects.url} is a Zarr group but not a vsekit store (no vsekit_format attribute)")
        if attrs.get("complete") is False:
            raise StoreError(f"{objects.url}: its ingest has not finished (or was killed before it did); rerun "
                             f"the ingest into a new URL, or delete these objects and ingest again")
        if int(attrs["vsekit_format"]) > FORMAT_VERSION:
            raise FormatVersionError(
                f"{objects.url} was written in vsekit store format {attrs['vsekit_format']}, newer than this "
                f"vsekit ({__version__}) reads (format {FORMAT_VERSION}); upgrade vsekit")
        root = zarr.open_group(objects.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3)
        return cls(root, objects.url, objects)

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "r", storage_options: Any = None) -> "FeatureStore":
        from .objstore import is_object_url

        if is_object_url(os.fspath(path)):
            return cls._open_remote(os.fspath(path), mode, storage_options)
        path = local_path(path)
        if not (path / "zarr.json").exists():
            raise StoreError(not_a_store(path))
        try:
            root = zarr.open_group(str(path), mode=mode, zarr_format=3)
        except Exception as exc:  # corrupt metadata
            raise StoreError(f"cannot open {path} as a Zarr v3 group: {exc}") from exc
        version = root.attrs.get("vsekit_format")
        if version is None:
            raise StoreError(f"{path} is a Zarr group but not a vsekit store (no vsekit_format attribute)")
        if int(version) > FORMAT_VERSION:
            raise FormatVersionError(
                f"{path} was written in vsekit store format {version}, newer than this vsekit "
                f"({__version__}) reads (format {FORMAT_VERSION}); upgrade vsekit")
        return cls(root, path)

    @classmethod
    @contextlib.contextmanager
    def building(cls, path: str | os.PathLike, *, overwrite: bool = False, drop_features: bool = False,
                 **create_kw: Any) -> Iterator["FeatureStore"]:
        """Create a store in a staging folder and move it into place only when the block succeeds.

        Ingestion uses this, so a failed ingest leaves nothing behind that looks like a store. Replacing
        a store that holds feature sets (hours of extraction) needs ``drop_features`` as well as
        ``overwrite``: a new split alone is ``vsekit split``, which keeps them.
        """
        from . import lock
        from .objstore import is_object_url

        if is_object_url(os.fspath(path)):
            with cls._building_remote(os.fspath(path), overwrite=overwrite, drop_features=drop_features,
                                      **create_kw) as store:
                yield store
            return
        path = local_path(path)
        with lock.creating_store(path), contextlib.ExitStack() as held_store:
            if path.exists() and not overwrite:
                raise StoreError(f"{path} already exists; pass --overwrite to replace it")
            if path.exists():   # refused while any writer holds a lock in it; writers refused from now on
                held_store.enter_context(lock.replacing_store(path))
                if not drop_features:
                    refuse_dropping_features(path)
            remove_stale_staging(path)
            staging = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
            store = cls.create(staging, overwrite=True, **create_kw)
            held = lock.acquire(staging, INGEST_LOCK, "vsekit ingest")   # marks the folder as live
            try:
                yield store
                point("ingest:complete")
                store.root.attrs["complete"] = True
                point("ingest:rename")
                from .objcommit import swap_dir

                swap_dir(staging, path)
                store.path = path
                store.root = zarr.open_group(str(path), mode="r+", zarr_format=3)
                lock.release(path, INGEST_LOCK, held)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

    @classmethod
    @contextlib.contextmanager
    def _building_remote(cls, url: str, *, overwrite: bool, drop_features: bool = False,
                         **create_kw: Any) -> Iterator["FeatureStore"]:
        """An ingest into an object-store URL: the store's root is created first (create-if-absent: one
        ingest per URL) and marked complete last; a failed ingest deletes what it wrote. An existing
        store is replaced only with ``overwrite`` (:meth:`_replacing_remote`)."""
        from .objstore import Objects, parse_options

        objects = Objects(url, parse_options(create_kw.get("storage_options")))
        if overwrite and (objects.get("zarr.json") is not None or objects.get(STORE_SWAP) is not None):
            with cls._replacing_remote(objects, drop_features=drop_features, **create_kw) as store:
                yield store
            return
        store = cls.create(url, **create_kw)
        try:
            with contextlib.ExitStack() as leases:
                store._new_store_leases = leases   # create_features takes each new set's lease here
                yield store
            store._new_store_leases = None
            point("ingest:complete")
            store.root.attrs["complete"] = True
        except BaseException:
            _delete_keys(store.objects, "")
            raise

    @classmethod
    @contextlib.contextmanager
    def _replacing_remote(cls, objects: Any, *, drop_features: bool, **create_kw: Any) -> Iterator["FeatureStore"]:
        """``ingest --overwrite`` of a store on object storage (docs/store.md, "Replacing a store"). Under
        the store's lease (``.vsekit/leases/.store.json``, refused while any set's lease in it is live;
        set writers refuse to start while it is held), with the old store's feature sets refused unless
        ``drop_features``: the new store is built whole under the hidden prefix ``.vsekit/next-*`` of
        the URL (a nested store no Zarr reader of the old one lists), and the old store is not touched
        until it is complete. Then the swap mark ``.vsekit/swaps/store.json`` is written and
        :func:`finish_store_replace` swaps it in. A failed ingest deletes the nested store (the old one
        stays whole); a run killed in the swap leaves the mark, opening the URL names it, and the next
        ``ingest --overwrite`` of the URL finishes the swap first."""
        from .objstore import dumps

        if objects.url.startswith("memory://"):
            raise StoreError(f"--store {objects.url}: --overwrite of a memory:// store is not supported (it has "
                             f"no nested prefixes); ingest into a new memory:// URL")
        holder = cls(None, objects.url, objects)
        with holder.store_writer("vsekit ingest --overwrite", what="replace"):
            finish_store_replace(objects, holder)   # a killed replacement is finished first
            if not drop_features:
                refuse_dropping_features(objects.url, objects)
            for child in objects.children(".vsekit/"):   # nested stores killed ingests left
                if child.startswith("next-"):
                    _delete_keys(objects, f".vsekit/{child}/")
            staging = f".vsekit/next-{uuid.uuid4().hex[:8]}"
            store = cls.create(f"{objects.url}/{staging}", **create_kw)
            try:
                with contextlib.ExitStack() as leases:
                    store._new_store_leases = leases
                    yield store
                store._new_store_leases = None
                point("ingest:complete")
                store.root.attrs["complete"] = True
            except BaseException:
                _delete_keys(objects, f"{staging}/")
                raise
            holder.check_lease(STORE_LEASE)
            point("ingest:replace:mark")
            objects.put(STORE_SWAP, dumps({"staging": staging, "token": holder.lease_token}))
            finish_store_replace(objects, holder)
            store.objects, store.path = objects, objects.url
            store.root = zarr.open_group(objects.zarr_store(), mode="r+", zarr_format=3)

    # attributes -----------------------------------------------------------------------------------
    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.root.attrs)

    @property
    def dataset(self) -> str:
        return str(self.root.attrs.get("dataset", ""))

    @property
    def image_root(self) -> Path:
        return Path(self.root.attrs.get("image_root") or ".")

    # images ---------------------------------------------------------------------------------------
    def write_images(self, ids: Sequence[str], paths: Sequence[str], splits: Sequence[str | int]) -> None:
        ids = [str(i) for i in ids]
        if len(set(ids)) != len(ids):
            seen, dup = set(), None
            for i in ids:
                if i in seen:
                    dup = i
                    break
                seen.add(i)
            raise StoreError(f"duplicate image id {dup!r}")
        if not (len(ids) == len(paths) == len(splits)):
            raise StoreError("images: ids, paths and splits must have the same length")
        codes = np.asarray([split_code(s) for s in splits], dtype=np.uint8)
        g = self.root.require_group("images")
        _write_strings(g, "id", ids)
        _write_strings(g, "path", [str(p) for p in paths])
        _write_array(g, "split", codes)

    @property
    def n_images(self) -> int:
        return int(self.root["images/id"].shape[0]) if "images" in self.root else 0

    def image_ids(self) -> np.ndarray:
        return np.asarray(self.root["images/id"][:], dtype=object)

    def image_paths(self) -> np.ndarray:
        return np.asarray(self.root["images/path"][:], dtype=object)

    def image_splits(self) -> np.ndarray:
        return np.asarray(self.root["images/split"][:], dtype=np.uint8)

    def split_rows(self, split: str | int | Iterable[str | int]) -> np.ndarray:
        """Image rows of one split, or of several (``"train,restval"`` or a list)."""
        if isinstance(split, str) and "," in split:
            split = split.split(",")
        names = [split] if isinstance(split, (str, int, np.integer)) else list(split)
        codes = [split_code(s) for s in names]
        return np.flatnonzero(np.isin(self.image_splits(), codes))

    def image_file(self, row: int) -> Path | str:
        """Row ``row``'s image: a path, or a URL where the image root is on object storage."""
        from .sources.remote import image_url, join

        rel, url = self.root["images/path"][row], image_url(self)
        return join(url, str(rel)) if url else self.image_root / str(rel)

    # captions -------------------------------------------------------------------------------------
    def write_captions(self, text: Sequence[str], image_rows: Sequence[int]) -> None:
        image_rows = np.asarray(image_rows, dtype=np.int64)
        if len(text) != len(image_rows):
            raise StoreError("captions: text and image rows must have the same length")
        if len(image_rows) and (image_rows.min() < 0 or image_rows.max() >= self.n_images):
            bad = int(np.flatnonzero((image_rows < 0) | (image_rows >= self.n_images))[0])
            raise StoreError(f"caption {bad} refers to image row {image_rows[bad]}, "
                             f"but the store has {self.n_images} images")
        g = self.root.require_group("captions")
        _write_strings(g, "text", [str(t) for t in text])
        _write_array(g, "image", image_rows)

    @property
    def n_captions(self) -> int:
        return int(self.root["captions/text"].shape[0]) if "captions" in self.root else 0

    def caption_text(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.asarray(self.root["captions/text"][start:stop], dtype=object)

    def caption_images(self) -> np.ndarray:
        return np.asarray(self.root["captions/image"][:], dtype=np.int64)

    def captions_of_split(self, split: str | int | Iterable[str | int]) -> np.ndarray:
        rows = self.split_rows(split)
        return np.flatnonzero(np.isin(self.caption_images(), rows))

    # features -------------------------------------------------------------------------------------
    def feature_names(self) -> list[str]:
        """Names of the feature sets (hidden ``.name.partial-*`` sets being built are left out)."""
        if "features" not in self.root:
            return []
        import warnings

        with warnings.catch_warnings():   # object storage: a set not yet published is skipped, not a warning
            warnings.simplefilter("ignore")
            return sorted(k for k in self.root["features"].group_keys() if not k.startswith("."))

    def has_features(self, name: str) -> bool:
        return name in self.feature_names()

    def features(self, name: str, expect: Mapping[str, Any] | None = None, *,
                 complete: bool = False) -> FeatureSet:
        if self.remote:
            self.refuse_if_replacing(name)
            staged = (bool(_STAGING_NAME.match(name))
                      and self.objects.get(f"features/{name}/zarr.json") is not None)
        else:
            staged = STAGED in name and (self.path / "features" / name / "zarr.json").exists()
        if not self.has_features(name) and not staged:   # a staged set is opened by its writers only
            raise StoreError(no_feature_set(name, self.path, self.feature_names()))
        return FeatureSet(self, name).check(expect, complete=complete)

    @names_store_path
    def create_features(self, name: str, row_shape: Sequence[int], dtype: Any, *,
                        attrs: Mapping[str, Any], n_rows: int | None = None,
                        block_rows: int | None = None, parent: str | None = None,
                        extra: Mapping[str, tuple[Sequence[int], Any]] | None = None,
                        overwrite: bool = False, compressors: Any = "auto",
                        init: Callable[[FeatureSet], None] | None = None,
                        beside: bool = False) -> FeatureSet:
        """Create (or reopen, for resume) the feature set ``name``.

        ``row_shape`` is the shape of one row (``(D,)``, ``(G, G, C)``, ``(K, C)``). ``extra``
        names auxiliary per-row arrays (``{"boxes": ((K, 4), "float32")}``), chunked like ``data``.
        If the set exists with the same ``config_hash`` it is reopened so a rerun resumes; with a
        different hash it is refused unless ``overwrite``. ``compressors="auto"`` picks
        :func:`default_compressors`. ``init(fs)`` may write more arrays and attrs (standardize's
        statistics) before the set appears: the set is built under a hidden name and renamed into
        place, so it is either absent or complete (a kill at any point leaves no half-made set).
        Callers that write hold the set's lock (:mod:`vsekit.storage.lock`).

        Every new set gets a fresh ``generation`` (a random id in its attrs, not part of the config
        hash): a reader that records it can tell that the set was made again meanwhile. With
        ``beside`` and ``overwrite``, an existing set is not replaced here: the new one is returned
        under a hidden name (``fs.staged``), the old one stays readable, and the caller swaps them
        with :meth:`commit` once the new one is written (or drops it with :meth:`discard`).
        """
        if not name or "/" in name:
            raise StoreError(f"invalid feature set name {name!r}")
        if name.startswith(".") and not _STAGING_NAME.match(name):
            raise StoreError(f"invalid feature set name {name!r}: names starting with '.' are the store's own "
                             f"(sets being built, locks); choose a --name without the leading '.'")
        n_rows = self.n_images if n_rows is None else int(n_rows)
        row_shape = tuple(int(s) for s in row_shape)
        dtype = np.dtype(dtype)
        attrs = _jsonable(dict(attrs))
        attrs.setdefault("code_version", __version__)
        attrs.setdefault("config_hash", config_hash({k: v for k, v in attrs.items() if k != "code_version"}))
        attrs.setdefault("generation", uuid.uuid4().hex)   # an import keeps the one it copies
        if parent is not None:
            if not self.has_features(parent):
                raise StoreError(f"parent feature set {parent!r} does not exist in {self.path}")
            attrs["parent"] = parent
        self.remove_leftovers(name)
        if self.has_features(name):
            existing = FeatureSet(self, name)
            same = (existing.attrs.get("config_hash") == attrs["config_hash"]
                    and existing.shape == (n_rows, *row_shape) and existing.data.dtype == dtype)
            if same and not overwrite:
                if self.remote:   # a writer killed between a block's record and its status
                    from .objcommit import reconcile

                    reconcile(existing)
                return existing
            if not overwrite:
                diff = settings_diff(existing.attrs, attrs)
                if existing.shape != (n_rows, *row_shape):
                    diff.append(f"shape {existing.shape} → {(n_rows, *row_shape)}")
                if existing.data.dtype != dtype:
                    diff.append(f"dtype {existing.data.dtype} → {dtype}")
                raise ProvenanceError(
                    f"feature set {name!r} already exists in {self.path} with different settings "
                    f"({'; '.join(diff) or 'another vsekit version'}); "
                    f"pass --overwrite to replace it or --name to write a new set")
        if block_rows is None:
            block_rows = row_chunk_for(int(np.prod(row_shape or (1,))) * dtype.itemsize)
        block_rows = max(1, min(int(block_rows), max(1, n_rows)))
        if self.remote:
            held = getattr(self, "_new_store_leases", None)
            if held is not None and name not in self.leases:   # a set of a store its ingest is building
                held.enter_context(self.writer(name, stage="vsekit ingest"))
            if overwrite and self.has_features(name):   # built beside it, swapped in by commit()
                staging = f".{name}.{STAGED}{uuid.uuid4().hex[:8]}"
                fs = self._create_remote_set(staging, n_rows, row_shape, dtype, block_rows, extra, compressors,
                                             attrs, init)
                fs = FeatureSet(self, staging, target=name)
                return fs if beside else self.commit(fs)
            return self._create_remote_set(name, n_rows, row_shape, dtype, block_rows, extra, compressors, attrs,
                                           init)
        replace_later = beside and self.has_features(name)
        staging = f".{name}.{STAGED if replace_later else 'creating-'}{uuid.uuid4().hex[:8]}"
        g = self.root.require_group("features").create_group(staging)
        try:
            fs = self._build(g, staging, n_rows, row_shape, dtype, block_rows, extra, compressors, attrs, init)
        except BaseException:
            shutil.rmtree(self.path / "features" / staging, ignore_errors=True)
            raise
        if replace_later:
            return FeatureSet(self, staging, target=name)
        point("create_features:rename")
        self._replace(name, staging)
        return FeatureSet(self, name)

    def _build(self, g: zarr.Group, staging: str, n_rows: int, row_shape: tuple, dtype: np.dtype,
               block_rows: int, extra: Mapping[str, tuple[Sequence[int], Any]] | None, compressors: Any,
               attrs: dict[str, Any], init: Callable[[FeatureSet], None] | None) -> FeatureSet:
        """The arrays and attrs of a new set in the hidden group ``g`` (see :meth:`create_features`)."""
        if compressors == "auto":
            compressors = default_compressors(row_shape, dtype, attrs.get("kind"))
        kw = {} if compressors == "auto" else {"compressors": compressors}
        point("create_features:arrays")
        g.create_array("data", shape=(n_rows, *row_shape), dtype=dtype,
                       chunks=(block_rows, *row_shape), fill_value=0, **kw)
        g.create_array("status", shape=(n_rows,), dtype=np.uint8, chunks=(block_rows,), fill_value=0)
        for aux, (shape, aux_dtype) in (extra or {}).items():
            shape = tuple(int(s) for s in shape)
            g.create_array(aux, shape=(n_rows, *shape), dtype=np.dtype(aux_dtype),
                           chunks=(block_rows, *shape), fill_value=0)
        integrity.create_sums(g, ["data", *(extra or {})], n_rows, block_rows)
        attrs["block_rows"] = block_rows
        point("create_features:attrs")
        g.attrs.update(attrs)
        fs = FeatureSet.__new__(FeatureSet)
        fs.store, fs.name, fs.target, fs.group = self, staging, staging, g
        if init is not None:
            init(fs)
        return fs

    def _create_remote_set(self, name: str, n_rows: int, row_shape: tuple, dtype: np.dtype, block_rows: int,
                           extra: Any, compressors: Any, attrs: dict[str, Any],
                           init: Callable[[FeatureSet], None] | None = None) -> FeatureSet:
        """A new set on object storage: its arrays' metadata written where the set lives, then the set
        published by one create-if-absent of its ``zarr.json`` (storage/objcommit.py). A set published
        meanwhile by another run is compared by its settings hash: reopened, or refused."""
        from .objcommit import group_meta

        mem = zarr.open_group(zarr.storage.MemoryStore(), mode="w", zarr_format=3)
        g = mem.create_group("set")
        self._build(g, name, n_rows, row_shape, dtype, block_rows, extra, compressors, attrs, init)
        objects = self.objects
        self.root.require_group("features")
        meta = None
        for key, buf in sorted(mem.store._store_dict.items()):
            if not key.startswith("set/"):
                continue
            if key == "set/zarr.json":
                meta = json.loads(buf.to_bytes())
                continue
            objects.put(f"features/{name}/{key[4:]}", buf.to_bytes())
        point("create_features:publish")
        if objects.create(f"features/{name}/zarr.json", group_meta(meta["attributes"])) is None:
            have = (objects.get_json(f"features/{name}/zarr.json") or ({}, None))[0].get("attributes") or {}
            if have.get("config_hash") != attrs.get("config_hash"):
                raise ProvenanceError(
                    f"feature set {name!r} was just created in {self.path} by another run with different "
                    f"settings ({'; '.join(settings_diff(have, attrs)) or 'another vsekit version'}); "
                    f"pass --name to write a new set")
        return FeatureSet(self, name)

    def commit(self, fs: FeatureSet) -> FeatureSet:
        """Swap a staged set (built beside the one it replaces) into place; returns the set by its name."""
        if not fs.staged:
            return fs
        if self.remote:
            self._replace_remote(fs.target, fs.name)
        else:
            self._replace(fs.target, fs.name)
        return FeatureSet(self, fs.target)

    def discard(self, fs: FeatureSet) -> None:
        """Drop a staged set that was not finished: the set it would have replaced stays as it was."""
        if fs.staged and self.remote:
            if self.objects.get(replace_mark(fs.target)) is None:   # never one a swap mark names
                self._delete_remote_set(fs.name)
        elif fs.staged:
            shutil.rmtree(self.path / "features" / fs.name, ignore_errors=True)

    @contextlib.contextmanager
    def building_features(self, name: str, row_shape: Sequence[int], dtype: Any, *,
                          overwrite: bool = False, **create_kw: Any) -> Iterator[FeatureSet]:
        """Create feature set ``name`` under a hidden staging name and rename it into place on success.

        Ingesters that add a set to an existing store use this, so a failure part-way leaves no
        half-written set behind (the store's other contents are untouched).
        """
        if self.remote:
            with self._building_features_remote(name, row_shape, dtype, overwrite=overwrite, **create_kw) as fs:
                yield fs
            return
        from .lock import writer_lock

        with writer_lock(self.path, name, stage="vsekit ingest"):
            if self.has_features(name) and not overwrite:
                raise StoreError(f"feature set {name!r} already exists in {self.path}; "
                                 f"pass --overwrite to replace it or --name to write a new set")
            staging = f".{name}.partial-{uuid.uuid4().hex[:8]}"
            fs = self.create_features(staging, row_shape, dtype, **create_kw)
            try:
                yield fs
                self._replace(name, staging)
                fs.name, fs.group = name, self.root[f"features/{name}"]
            except BaseException:
                shutil.rmtree(self.path / "features" / staging, ignore_errors=True)
                raise

    @contextlib.contextmanager
    def _building_features_remote(self, name: str, row_shape: Sequence[int], dtype: Any, *,
                                  overwrite: bool = False, **create_kw: Any) -> Iterator[FeatureSet]:
        """:meth:`building_features` on object storage, which has no rename: under the set's lease the
        set is built and committed block by block under a hidden name (``.NAME.partial-*``, listed by
        no reader), then swapped in as an ``--overwrite`` is (:meth:`_replace_remote`): readers see no
        set (or the old one), then a whole one. A failure before the swap deletes the hidden set; one a
        killed run left is deleted by the next run under the lease, and a swap it left half-done is
        finished by the next writer of NAME."""
        with self.writer(name, stage="vsekit ingest"):
            # a set a killed ingest had built new and this run's lease published is made again, not refused
            if self.has_features(name) and not overwrite and not self.finished_swaps.get(name, {}).get("new"):
                raise StoreError(f"feature set {name!r} already exists in {self.path}; "
                                 f"pass --overwrite to replace it or --name to write a new set")
            self.remove_leftovers(name)
            staging = f".{name}.partial-{uuid.uuid4().hex[:8]}"
            fs = self.create_features(staging, row_shape, dtype, **create_kw)
            fs.target = name   # its blocks are committed under NAME's lease
            try:
                yield fs
                self._replace_remote(name, staging)
                fs.name, fs.target, fs.group = name, name, self.root[f"features/{name}"]
            except BaseException:
                if self.objects.get(replace_mark(name)) is None:   # not yet handed to the swap
                    self._delete_remote_set(staging)
                raise

    # replacing a set on object storage ------------------------------------------------------------
    def _replace_remote(self, name: str, staging: str) -> None:
        """Swap the complete hidden set ``staging`` in as ``name`` on object storage (no rename), under
        NAME's lease: write the swap mark (``.vsekit/swaps/features/NAME.json``: the staged set and its
        generation), then :meth:`_finish_remote_replace`. From the mark on the swap is finished by this
        run, or by the next writer of NAME if this one is killed (docs/store.md, "Replacing a set")."""
        from .objstore import dumps

        got = self.objects.get_json(f"features/{staging}/zarr.json")
        if got is None:
            raise StoreError(f"feature set {staging!r} in {self.path} is gone; it cannot replace {name!r}")
        self.check_lease(name)
        point("replace:mark")
        self.objects.put(replace_mark(name), dumps({
            "staging": staging, "generation": (got[0].get("attributes") or {}).get("generation"),
            "new": not self.has_features(name), "token": self.lease_token}))
        self._finish_remote_replace(name)

    def _finish_remote_replace(self, name: str) -> dict | None:
        """Finish the swap the mark of ``name`` describes (run under NAME's lease); returns the mark, or
        None when there is none. Each step can be done again, so a run killed anywhere here leaves the mark and the next
        writer of NAME calls this again: the old set's ``zarr.json`` is deleted first (from then on no
        reader lists the set, and :meth:`features` names the swap), then every old object and every
        commit record of NAME (the old generation's included), then the staged objects and records are
        copied under NAME on the provider, the set is published by one create-if-absent of its
        ``zarr.json``, and only then are the mark and the staged set deleted."""
        from .objcommit import group_meta, swap_in

        objects = self.objects
        mark = objects.get_json(replace_mark(name))
        if mark is None:
            return None
        staging, gen = mark[0].get("staging"), mark[0].get("generation")
        src, dst = f"features/{staging}/", f"features/{name}/"
        rsrc, rdst = f".vsekit/commits/{staging}/", f".vsekit/commits/{name}/"
        have = objects.get_json(dst + "zarr.json")
        if have is None or (have[0].get("attributes") or {}).get("generation") != gen or not gen:
            meta = objects.get_json(src + "zarr.json")
            if meta is None:
                raise StoreError(f"{self.path}: {replace_mark(name)} says {staging!r} replaces feature set "
                                 f"{name!r}, but {staging!r} has no zarr.json; delete that mark and run the "
                                 f"command that makes {name!r} again with --overwrite")
            swapped = swap_in(objects, [(src, dst), (rsrc, rdst)], group_meta(meta[0].get("attributes") or {}),
                              step=lambda at: point(f"replace:{at}"), check=lambda: self.check_lease(name))
            if not swapped:
                raise StoreError(f"feature set {name!r} was published in {self.path} by another run meanwhile")
        point("replace:cleanup")
        objects.delete(replace_mark(name))
        self._delete_remote_set(staging)
        return mark[0] or {"finished": True}

    def refuse_if_replacing(self, name: str) -> None:
        """One clear error while feature set ``name`` is being replaced on object storage (its swap mark
        is there): a reader never gets a mix of the old and the new set, or fill values for the old
        set's deleted chunks."""
        got = self.objects.get_json(replace_mark(name))
        if got is None:
            return
        raise StoreError(f"feature set {name!r} in {self.path} is being replaced (an --overwrite is swapping "
                         f"the new set in, or one was killed while it did); wait for it to finish, or if it "
                         f"was killed, run any command that writes {name!r} (the same one with --overwrite): "
                         f"it finishes the swap first")

    def _delete_remote_set(self, name: str) -> None:
        """Delete every object of the (hidden) set ``name`` on object storage: its zarr.json first, so
        it is listed by no reader from then on, then its arrays and its commit records."""
        self.objects.delete(f"features/{name}/zarr.json")
        for prefix in (f"features/{name}/", f".vsekit/commits/{name}/"):
            for key in self.objects.keys(prefix):
                self.objects.delete(key)

    def _remove_remote_staged(self, name: str) -> list[str]:
        """Delete the hidden ``.NAME.partial-*`` / ``.NAME.next-*`` sets killed runs left (under NAME's
        lease, after a half-done swap is finished: no live run builds one then)."""
        gone = [c for c in self.objects.children("features/")
                if c.startswith((f".{name}.partial-", f".{name}.{STAGED}")) and _STAGING_NAME.match(c)]
        for child in gone:
            self._delete_remote_set(child)
        return gone

    def delete_features(self, name: str) -> None:
        if self.has_features(name):
            del self.root["features"][name]

    def _replace(self, name: str, staging: str) -> None:
        """Rename the complete hidden set ``staging`` to ``name``; an old ``name`` is moved aside first."""
        from .objcommit import swap_dir

        base = self.path / "features"
        swap_dir(base / staging, base / name, step=lambda: point("create_features:swap"))

    def remove_leftovers(self, name: str) -> list[str]:
        """Remove hidden ``.NAME.creating-*`` / ``.old-*`` / ``.partial-*`` / ``.next-*`` folders a killed run left.

        Call only while holding ``name``'s writer lock (no live run is then building it).
        """
        if self.remote:
            if name not in self.leases:   # only under NAME's lease (no live run builds one then)
                return []
            return self._remove_remote_staged(name)
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

    # tokens ---------------------------------------------------------------------------------------
    @property
    def has_tokens(self) -> bool:
        return "tokens" in self.root and "offsets" in self.root["tokens"]

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, images={self.n_images}, captions={self.n_captions})"


# helpers ------------------------------------------------------------------------------------------
_STAGING_NAME = re.compile(r"^\..+\.(partial|creating|old|next)-[0-9a-f]{8}$")   # the store's hidden sets


def owner_of(name: str) -> str:
    """The set a hidden staged set (``.NAME.next-*``, ``.NAME.partial-*``) is built for; else ``name``."""
    m = _STAGING_NAME.match(name)
    return name[1:name.rindex(".")] if m and m.group(1) in ("next", "partial") else name


def replace_mark(name: str) -> str:
    """The swap mark of feature set ``name`` on object storage (see :meth:`FeatureStore._replace_remote`)."""
    return f".vsekit/swaps/features/{name}.json"


STORE_SWAP = ".vsekit/swaps/store.json"   # an `ingest --overwrite` swapping a new store in (object storage)


def _delete_keys(objects: Any, prefix: str) -> None:
    """Delete every object under ``prefix``; its ``zarr.json`` last, so a store is listed until nothing
    else of it is left."""
    for key in sorted(objects.keys(prefix), key=lambda k: k == f"{prefix}zarr.json"):
        objects.delete(key)


def refuse_if_store_replaced(objects: Any) -> None:
    """One clear error while the store at ``objects.url`` is being replaced (its swap mark is there)."""
    if objects.get(STORE_SWAP) is None:
        return
    raise StoreError(f"{objects.url} is being replaced by `vsekit ingest ... --overwrite` (it is swapping the new "
                     f"store in, or it was killed while it did); wait for it to finish, or if it was killed, "
                     f"run that ingest --overwrite again: it finishes the swap first")


def finish_store_replace(objects: Any, holder: "FeatureStore") -> bool:
    """Swap in the complete nested store the mark ``.vsekit/swaps/store.json`` names (under the store's
    lease; False without a mark). Every step can be done again, and a run killed anywhere here leaves
    the mark: the old root ``zarr.json`` is deleted first (from then on opening the URL names the
    swap), then every other object of the old store (the nested store, the mark and the store lease
    excepted), then the nested store's objects are copied to the root on the provider, the root
    ``zarr.json`` is written last by create-if-absent, and only then are the mark and the nested
    store deleted."""
    mark = objects.get_json(STORE_SWAP)
    if mark is None:
        return False
    staging = str(mark[0].get("staging") or "")
    src = f"{staging}/"
    meta = objects.get(src + "zarr.json")
    if not staging.startswith(".vsekit/next-") or meta is None:
        raise StoreError(f"{objects.url}: {STORE_SWAP} names a new store {staging!r} that is not there; "
                         f"delete {STORE_SWAP} and ingest again with --overwrite")
    from . import objcommit

    # the old store's objects go, but the nested store, the mark and the lease this run holds
    swapped = objcommit.swap_in(objects, [(src, "")], meta[0], step=lambda at: point(f"ingest:replace:{at}"),
                                check=lambda: holder.check_lease(STORE_LEASE),
                                keep=(src, STORE_SWAP, f".vsekit/leases/{STORE_LEASE}.json"), skip=(".vsekit/leases/",))
    if not swapped:
        raise StoreError(f"{objects.url}: another run created a store there meanwhile")
    point("ingest:replace:cleanup")
    objects.delete(STORE_SWAP)
    _delete_keys(objects, src)
    return True


def refuse_dropping_features(path: str | os.PathLike, objects: Any = None) -> None:
    """Refuse to replace a store whose feature sets would go with it (``--drop-features`` allows it)."""
    from ..words import plural

    if objects is not None:   # object storage: the published sets of what is there, readable or not
        names = [c for c in objects.children("features/") if not c.startswith(".")
                 and objects.get(f"features/{c}/zarr.json") is not None]
    else:
        path = Path(path)
        if not (path / "zarr.json").is_file():
            return
        try:
            names = FeatureStore.open(path).feature_names()
        except StoreError:   # not a readable store: nothing of vsekit's to lose
            return
    if not names:
        return
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    raise StoreError(f"{path} holds {plural(len(names), 'feature set')} ({shown}); --overwrite would delete "
                     f"them. To change only the split, keep them: `vsekit split --store {path} --ratios ...` "
                     f"(or --split-file, or --val N --test N). To re-ingest and delete them, add --drop-features")


def store_exists(path: str | os.PathLike) -> bool:
    """Whether a store (its root ``zarr.json``) is at ``path``, a local path or an object-store URL."""
    from .objstore import Objects, is_object_url

    if is_object_url(os.fspath(path)):
        return Objects(os.fspath(path)).get("zarr.json") is not None
    return (local_path(path) / "zarr.json").is_file()


def feature_names_at(path: str | os.PathLike) -> list[str]:
    """The feature sets of the store at ``path`` (none when there is no readable store there)."""
    try:
        return FeatureStore.open(path).feature_names() if store_exists(path) else []
    except StoreError:
        return []


INGEST_LOCK = "ingest"
STORE_LEASE = ".store"   # the lease `vsekit split` holds on object storage (lock.STORE_LOCK on disk)
STALE_STAGING_S = 60.0   # a staging folder without a lock file is a killed ingest's once this old


def remove_stale_staging(path: str | os.PathLike) -> list[Path]:
    """Remove the ``.NAME.partial-*`` / ``.NAME.old-*`` folders killed ingests of ``path`` left.

    A folder whose ingest lock names a live process is kept (another ingest is building it); one
    without a lock file is removed only when older than a minute (a live ingest writes its lock
    right after creating the folder).
    """
    import time

    from . import lock

    path = Path(path)
    gone = []
    if not path.parent.is_dir():
        return gone
    for p in path.parent.iterdir():
        if not (p.name.startswith(f".{path.name}.partial-") or p.name.startswith(f".{path.name}.old-")):
            continue
        lock_file = lock.lock_path(p, INGEST_LOCK)
        if lock_file.exists():
            if lock.holder(p, INGEST_LOCK) is not None:
                continue
        else:
            try:
                if time.time() - p.stat().st_mtime < STALE_STAGING_S:
                    continue
            except FileNotFoundError:
                continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    return gone



def _write_strings(group: zarr.Group, name: str, values: Sequence[str]) -> zarr.Array:
    if name in group:
        del group[name]
    arr = group.create_array(name, shape=(len(values),), dtype=str,
                             chunks=(max(1, min(STRING_CHUNK, len(values))),))
    if len(values):
        arr[:] = np.asarray(values, dtype=object)
    return arr


def _write_array(group: zarr.Group, name: str, values: np.ndarray, chunk: int = STRING_CHUNK) -> zarr.Array:
    if name in group:
        del group[name]
    values = np.asarray(values)
    arr = group.create_array(name, shape=values.shape, dtype=values.dtype,
                             chunks=(max(1, min(chunk, len(values))), *values.shape[1:]))
    if values.size:
        arr[:] = values
    return arr


def write_strings(group: zarr.Group, name: str, values: Sequence[str]) -> zarr.Array:
    """Public form of the variable-length string writer (used by ingestion and tokenisation)."""
    return _write_strings(group, name, values)


def write_array(group: zarr.Group, name: str, values: np.ndarray, chunk: int = STRING_CHUNK) -> zarr.Array:
    """Write a whole small array (replacing any existing one)."""
    return _write_array(group, name, values, chunk)
