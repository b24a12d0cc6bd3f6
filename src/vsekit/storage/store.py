"""The vsekit Zarr v3 store: images, captions, tokens and feature sets with provenance.

A feature set is written in row blocks aligned to its chunks (the unit of work, distribution and
resume), data before checksums before status, and a new set is built under a hidden name and put in
place whole. The layout and these guarantees: docs/store.md ("Layout") and docs/reliability.md.
"""

from __future__ import annotations

import contextlib
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
from . import integrity, lock, objsets
from .base import (DONE, FAILED, PENDING, STAGED, STAGING_NAME, STATUS_NAMES, Block,  # noqa: F401
                   FormatVersionError, ProvenanceError, StoreError, no_feature_set, not_a_store, owner_of,
                   read_generation)
from .dataset import STRING_CHUNK, DatasetRows, split_code, write_array, write_strings  # noqa: F401
from .faults import point
from .fserrors import names_set_path, names_store_path
from .meta import (FORMAT_VERSION, SPLIT_CODES, SPLITS, _jsonable, check_format, config_hash,  # noqa: F401
                   refuse_dropping, root_attrs, settings_diff)
from .objcommit import swap_dir
from .objsets import STORE_LEASE, STORE_SWAP, ObjectSets, replace_mark  # noqa: F401
from .sets import DiskSets, SetStorage
from .objstore import SERVED_BY, Objects, is_object_url, public_url


def row_chunk_for(row_bytes: int, target_bytes: int = 16 << 20, lo: int = 16, hi: int = 4096) -> int:
    """Rows per chunk so that a chunk holds about ``target_bytes`` (clamped to [lo, hi])."""
    rows = max(1, target_bytes // max(1, row_bytes))
    return int(min(hi, max(lo, rows)))


class FeatureSet:
    """One feature set: ``data`` (N, ...) and ``status`` (N,), plus provenance in attrs."""

    def __init__(self, store: "FeatureStore", name: str, target: str | None = None):
        self.store = store
        self.name = name
        # the name it takes when committed (see FeatureStore.commit); on object storage a task that opens a
        # staged set by its hidden name commits its blocks under the lease of the set it will replace
        self.target = target or owner_of(name)
        self.group = store.root[f"features/{name}"]

    @property
    def staged(self) -> bool:
        """True for a set built beside the one it will replace (``--overwrite``), not yet committed."""
        return self.target != self.name

    @property
    def generation(self) -> str | None:
        """The id made when this set was created; a set made again (``--overwrite``) has a new one."""
        return self.store.sets.generation(self.name)

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
        half-way is still pending on the next run. The guard is checked before the chunks and again
        right before the block's records (:meth:`.sets.SetStorage.commit_block`: checksums on a disk, a
        commit record on object storage). False (nothing written) when another writer committed the
        block first; True otherwise.
        """
        if isinstance(block, int):
            block = self.blocks()[block]
        if not self.store.sets.may_write(self, block):
            return False
        for name, values in arrays.items():
            point("write_block:aux")
            self.array(name)[block.start:block.stop] = values
        if data is not None:
            point("write_block:data")
            self.data[block.start:block.stop] = data
        if status is None:
            status = np.full(len(block), DONE, dtype=np.uint8)
        if not self.store.sets.commit_block(self, block, status):
            return False   # committed already by another writer: its status is restored from its record
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

    def settings_changed(self, attrs: Mapping[str, Any], shape: tuple, dtype: Any,
                         block_rows: int | None = None) -> str | None:
        """None when this set was made as ``attrs``, ``shape``, ``dtype`` (and ``block_rows``) say, so a
        rerun resumes it; else the refusal naming what differs."""
        pairs = [("shape", self.shape, tuple(shape)), ("dtype", self.data.dtype, np.dtype(dtype))]
        if block_rows is not None:
            pairs.append(("rows per block", self.chunk_rows, block_rows))
        moved = [f"{what} {have} → {want}" for what, have, want in pairs if have != want]
        if self.attrs.get("config_hash") == attrs["config_hash"] and not moved:
            return None
        return (f"feature set {self.name!r} already exists in {self.store.path} with different settings "
                f"({'; '.join(settings_diff(self.attrs, attrs) + moved) or 'another vsekit version'}); "
                f"pass --overwrite to replace it or --name to write a new set")

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
    if is_object_url(text):
        raise StoreError(f"--store {public_url(text)}: this command does not serve object-store stores yet; "
                         f"{match.group(1)}:// stores are served by {SERVED_BY} (issue 35)")
    raise StoreError(f"--store {text}: {match.group(1)}:// stores are not supported by this vsekit; a store is a "
                     f"local or shared-filesystem path, or s3://, gs://, az:// object storage")


class FeatureStore(DatasetRows):
    """A vsekit store: one Zarr v3 group per dataset. Its dataset's rows (:class:`.dataset.DatasetRows`)
    and how its sets are kept and guarded (``sets``: a :class:`.sets.SetStorage`, on a disk or on object
    storage, chosen here once) live in their own modules; opening, creating and the feature sets here."""

    def __init__(self, root: zarr.Group, path: str | os.PathLike, objects: Any = None):
        self.root = root
        self.objects = objects   # an objstore.Objects for an object-store URL, else None
        self.path = Path(path) if objects is None else objects.url
        self.leases: dict[str, Any] = {}   # set name → the SetLease this process holds (object storage)
        self.locks: dict[str, str] = {}    # set name → the token of the lock file this process holds (disk)
        self.lease_token: str | None = None   # the driver's lease token a dask task writes under
        self._new_store_leases: Any = None   # while an ingest builds this store on object storage
        self.finished_swaps: dict[str, dict] = {}   # set name → the mark of a killed run's swap this one finished
        self.sets: SetStorage = DiskSets(self) if objects is None else ObjectSets(self)

    def feature_set(self, name: str, target: str | None = None) -> FeatureSet:
        """The set ``name`` (a staged one: ``target``, the set it is built for), unchecked."""
        return FeatureSet(self, name, target)

    @property
    def remote(self) -> bool:
        """True for a store on object storage (``s3://``...): ``path`` is then its URL (a str)."""
        return self.objects is not None

    # opening --------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, *, dataset: str, image_root: str | os.PathLike = "",
               source_files: Sequence[str] = (), overwrite: bool = False,
               storage_options: Any = None) -> "FeatureStore":
        if is_object_url(os.fspath(path)):
            return objsets.create_store(cls, os.fspath(path), storage_options, dataset=dataset,
                                        image_root=image_root, source_files=source_files, overwrite=overwrite)
        path = local_path(path)
        if path.exists() and not overwrite:
            raise StoreError(f"{path} already exists; pass --overwrite to replace it")
        root = zarr.open_group(str(path), mode="w", zarr_format=3)
        root.attrs.update(root_attrs(dataset, image_root, source_files))
        return cls(root, path)

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "r", storage_options: Any = None) -> "FeatureStore":
        if is_object_url(os.fspath(path)):
            return objsets.open_store(cls, os.fspath(path), mode, storage_options)
        path = local_path(path)
        if not (path / "zarr.json").exists():
            raise StoreError(not_a_store(path))
        try:
            root = zarr.open_group(str(path), mode=mode, zarr_format=3)
        except Exception as exc:  # corrupt metadata
            raise StoreError(f"cannot open {path} as a Zarr v3 group: {exc}") from exc
        check_format(path, root.attrs)
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
        if is_object_url(os.fspath(path)):
            with objsets.building_store(cls, os.fspath(path), overwrite=overwrite, drop_features=drop_features,
                                        **create_kw) as store:
                yield store
            return
        path = local_path(path)
        with lock.creating_store(path), contextlib.ExitStack() as held_store:
            if path.exists() and not overwrite:
                raise StoreError(f"{path} already exists; pass --overwrite to replace it")
            if path.exists():   # refused while any writer holds a lock in it; writers refused from now on
                held_store.enter_context(cls(None, path).sets.store_writer("vsekit ingest --overwrite", "replace"))
                if not drop_features and (path / "zarr.json").is_file():
                    names: list[str] = []
                    with contextlib.suppress(StoreError):   # not a readable store: nothing of vsekit's to lose
                        names = FeatureStore.open(path).feature_names()
                    refuse_dropping(path, names)
            remove_stale_staging(path)
            staging = path.with_name(f".{path.name}.partial-{uuid.uuid4().hex[:8]}")
            store = cls.create(staging, overwrite=True, **create_kw)
            held = lock.acquire(staging, INGEST_LOCK, "vsekit ingest")   # marks the folder as live
            try:
                yield store
                point("ingest:complete")
                store.root.attrs["complete"] = True
                point("ingest:rename")
                swap_dir(staging, path)
                store.path = path
                store.root = zarr.open_group(str(path), mode="r+", zarr_format=3)
                lock.release(path, INGEST_LOCK, held)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

    # attributes -----------------------------------------------------------------------------------
    @property
    def attrs(self) -> dict[str, Any]:
        return dict(self.root.attrs)

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
        staged = self.sets.staged(name)
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
        if name.startswith(".") and not STAGING_NAME.match(name):
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
            changed = existing.settings_changed(attrs, (n_rows, *row_shape), dtype)
            if changed is None and not overwrite:
                self.sets.reconcile(existing)   # a writer killed between a block's record and its status
                return existing
            if not overwrite:
                raise ProvenanceError(changed)
        if block_rows is None:
            block_rows = row_chunk_for(int(np.prod(row_shape or (1,))) * dtype.itemsize)
        block_rows = max(1, min(int(block_rows), max(1, n_rows)))
        spec = (n_rows, row_shape, dtype, block_rows, extra, compressors, attrs, init)
        return self.sets.create(name, spec, replace=self.has_features(name), beside=beside)

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

    def commit(self, fs: FeatureSet) -> FeatureSet:
        """Swap a staged set (built beside the one it replaces) into place; returns the set by its name.
        The one swap entry point; the two protocols behind it: :meth:`.sets.SetStorage.swap`."""
        if not fs.staged:
            return fs
        self.sets.swap(fs.target, fs.name)
        return FeatureSet(self, fs.target)

    def discard(self, fs: FeatureSet) -> None:
        """Drop a staged set that was not finished: the set it would have replaced stays as it was."""
        if fs.staged:
            self.sets.discard(fs)

    def building_features(self, name: str, row_shape: Sequence[int], dtype: Any, *,
                          overwrite: bool = False, **create_kw: Any) -> contextlib.AbstractContextManager:
        """Create feature set ``name`` under a hidden staging name and swap it into place on success.

        Ingesters that add a set to an existing store use this, so a failure part-way leaves no
        half-written set behind (the store's other contents are untouched).
        """
        return self.sets.building(name, row_shape, dtype, overwrite, **create_kw)

    def refuse_existing(self, name: str, overwrite: bool) -> None:
        if self.has_features(name) and not overwrite:
            raise StoreError(f"feature set {name!r} already exists in {self.path}; "
                             f"pass --overwrite to replace it or --name to write a new set")

    def delete_features(self, name: str) -> None:
        if self.has_features(name):
            del self.root["features"][name]

    def remove_leftovers(self, name: str) -> list[str]:
        """Remove the hidden sets of ``name`` killed runs left (``.NAME.creating-*`` / ``.old-*`` /
        ``.partial-*`` / ``.next-*``). Call only while holding ``name``'s writer guard."""
        return self.sets.remove_leftovers(name)

    # the write guards (docs/store.md, "Write guards: states and transitions") ------------------------
    def check_lease(self, name: str) -> None:
        """Raise :class:`~.objstore.LeaseLost` unless this process may still commit blocks of ``name``:
        the one check of every guard before a block is written."""
        self.sets.check_lease(name)

    def writer(self, *names: str, stage: str, multi: bool = False) -> contextlib.AbstractContextManager:
        """Hold the one-writer guard of each of ``names`` (lock files on a disk, leases on object
        storage); a name this store holds already is held once (``fne`` holds both its sets)."""
        return self.sets.writer(names, stage, multi)

    def store_writer(self, stage: str, what: str = "re-split") -> contextlib.AbstractContextManager:
        """Hold the whole store's guard ``.store``, refused while any set's guard is live."""
        return self.sets.store_writer(stage, what)

    # tokens ---------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, images={self.n_images}, captions={self.n_captions})"


# helpers ------------------------------------------------------------------------------------------
def store_exists(path: str | os.PathLike) -> bool:
    """Whether a store (its root ``zarr.json``) is at ``path``, a local path or an object-store URL."""
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
STALE_STAGING_S = 60.0   # a staging folder without a lock file is a killed ingest's once this old


def remove_stale_staging(path: str | os.PathLike) -> list[Path]:
    """Remove the ``.NAME.partial-*`` / ``.NAME.old-*`` folders killed ingests of ``path`` left.

    A folder whose ingest lock names a live process is kept (another ingest is building it); one
    without a lock file is removed only when older than a minute (a live ingest writes its lock
    right after creating the folder).
    """
    import time
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


