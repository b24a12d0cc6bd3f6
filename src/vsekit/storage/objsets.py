"""Feature sets and whole stores on object storage (no rename): creating, publishing, opening and
replacing them (docs/store.md, "Stores on object storage", "Replacing a set or a store on object
storage"), as :class:`ObjectSets`, the object-storage half of :class:`~.store.FeatureStore`."""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import zarr
import zarr.storage

from .base import STAGED, STAGING_NAME, ProvenanceError, StoreError, not_a_store
from .faults import point
from .guards import STORE_LEASE
from .objcommit import group_meta, swap_in
from .objstore import Objects, dumps, parse_options, require_conditions
from .meta import check_format, refuse_dropping, root_attrs, settings_diff

if TYPE_CHECKING:  # pragma: no cover
    from .store import FeatureSet, FeatureStore

STORE_SWAP = ".vsekit/swaps/store.json"   # an `ingest --overwrite` swapping a new store in (object storage)


def replace_mark(name: str) -> str:
    """The swap mark of feature set ``name`` on object storage (see :meth:`FeatureStore._replace_remote`)."""
    return f".vsekit/swaps/features/{name}.json"


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


@contextlib.contextmanager
def _ingesting(store: "FeatureStore", objects: Objects, prefix: str) -> Iterator["FeatureStore"]:
    """An ingest building ``store`` (under ``prefix`` of ``objects``): each new set's lease is taken in
    it (:meth:`~.store.FeatureStore.create_features`), the store marked complete last; a failed ingest
    deletes what it wrote."""
    try:
        with contextlib.ExitStack() as leases:
            store._new_store_leases = leases
            yield store
        store._new_store_leases = None
        point("ingest:complete")
        store.root.attrs["complete"] = True
    except BaseException:
        _delete_keys(objects, prefix)
        raise


class ObjectSets:
    """The object-storage side of a :class:`~.store.FeatureStore` (``self.objects`` set)."""

    @classmethod
    def _create_remote(cls, url: str, storage_options: Any, *, dataset: str, image_root: Any,
                       source_files: Sequence[str], overwrite: bool) -> "FeatureStore":
        """A new store at an object-store URL: its root ``zarr.json`` created with create-if-absent (one
        ingest per URL), ``complete: false`` until the ingest finishes (:meth:`building`)."""
        objects = Objects(url, parse_options(storage_options))
        refuse_if_store_replaced(objects)
        require_conditions(objects, "vsekit ingest")   # one ingest per URL rests on create-if-absent
        if overwrite and objects.get("zarr.json") is not None:   # only ingest replaces one (building)
            raise StoreError(f"--store {objects.url}: a store on object storage is replaced by `vsekit ingest "
                             f"... --overwrite` only")
        if objects.create("zarr.json", group_meta(root_attrs(dataset, image_root, source_files))) is None:
            raise StoreError(f"{objects.url} already exists (it has a zarr.json); ingest into a new URL, or "
                             f"delete its objects first")
        root = zarr.open_group(objects.zarr_store(), mode="r+", zarr_format=3)
        return cls(root, objects.url, objects)

    @classmethod
    def _open_remote(cls, url: str, mode: str, storage_options: Any) -> "FeatureStore":
        objects = Objects(url, parse_options(storage_options))
        got = objects.get_json("zarr.json")
        if got is None:   # a store's objects are deleted only after its zarr.json (finish_store_replace)
            refuse_if_store_replaced(objects)
        if got is None:
            raise StoreError(not_a_store(objects.url))
        attrs = got[0].get("attributes") or {}
        check_format(objects.url, attrs)
        if attrs.get("complete") is False:
            raise StoreError(f"{objects.url}: its ingest has not finished (or was killed before it did); rerun "
                             f"the ingest into a new URL, or delete these objects and ingest again")
        root = zarr.open_group(objects.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3)
        return cls(root, objects.url, objects)

    @classmethod
    @contextlib.contextmanager
    def _building_remote(cls, url: str, *, overwrite: bool, drop_features: bool = False,
                         **create_kw: Any) -> Iterator["FeatureStore"]:
        """An ingest into an object-store URL: the store's root is created first (create-if-absent: one
        ingest per URL) and marked complete last; a failed ingest deletes what it wrote. An existing
        store is replaced only with ``overwrite`` (:meth:`_replacing_remote`)."""
        objects = Objects(url, parse_options(create_kw.get("storage_options")))
        if overwrite and (objects.get("zarr.json") is not None or objects.get(STORE_SWAP) is not None):
            with cls._replacing_remote(objects, drop_features=drop_features, **create_kw) as store:
                yield store
            return
        store = cls.create(url, **create_kw)
        with _ingesting(store, store.objects, ""):
            yield store

    @classmethod
    @contextlib.contextmanager
    def _replacing_remote(cls, objects: Any, *, drop_features: bool, **create_kw: Any) -> Iterator["FeatureStore"]:
        """``ingest --overwrite`` of a store on object storage, under the store's lease: the new store is
        built whole under the hidden prefix ``.vsekit/next-*`` of the URL, the old one untouched until
        then; then the swap mark is written and :func:`finish_store_replace` swaps it in. A failed
        ingest deletes the nested store; a swap a killed run left is finished by the next ``ingest
        --overwrite`` of the URL (docs/store.md, "Replacing a set or a store on object storage")."""
        if objects.url.startswith("memory://"):
            raise StoreError(f"--store {objects.url}: --overwrite of a memory:// store is not supported (it has "
                             f"no nested prefixes); ingest into a new memory:// URL")
        holder = cls(None, objects.url, objects)
        with holder.store_writer("vsekit ingest --overwrite", what="replace"):
            finish_store_replace(objects, holder)   # a killed replacement is finished first
            if not drop_features:
                refuse_dropping(objects.url, [c for c in objects.children("features/") if not c.startswith(".")
                                              and objects.get(f"features/{c}/zarr.json") is not None])
            for child in objects.children(".vsekit/"):   # nested stores killed ingests left
                if child.startswith("next-"):
                    _delete_keys(objects, f".vsekit/{child}/")
            staging = f".vsekit/next-{uuid.uuid4().hex[:8]}"
            store = cls.create(f"{objects.url}/{staging}", **create_kw)
            with _ingesting(store, objects, f"{staging}/"):
                yield store
            holder.check_lease(STORE_LEASE)
            point("ingest:replace:mark")
            objects.put(STORE_SWAP, dumps({"staging": staging, "token": holder.lease_token}))
            finish_store_replace(objects, holder)
            store.objects, store.path = objects, objects.url
            store.root = zarr.open_group(objects.zarr_store(), mode="r+", zarr_format=3)

    def _create_remote_set(self, name: str, n_rows: int, row_shape: tuple, dtype: np.dtype, block_rows: int,
                           extra: Any, compressors: Any, attrs: dict[str, Any],
                           init: Callable[[Any], None] | None = None) -> Any:
        """A new set on object storage: its arrays' metadata written where the set lives, then the set
        published by one create-if-absent of its ``zarr.json`` (storage/objcommit.py). A set published
        meanwhile by another run is compared by its settings hash: reopened, or refused."""
        
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
        return self.feature_set(name)

    @contextlib.contextmanager
    def _building_features_remote(self, name: str, row_shape: Sequence[int], dtype: Any, *,
                                  overwrite: bool = False, **create_kw: Any) -> Iterator[FeatureSet]:
        """:meth:`building_features` on object storage, which has no rename: under the set's lease the
        set is built and committed under a hidden name (``.NAME.partial-*``), then swapped in as an
        ``--overwrite`` is (:meth:`_replace_remote`); a failure before the swap deletes it."""
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

    def _replace_remote(self, name: str, staging: str) -> None:
        """Swap the complete hidden set ``staging`` in as ``name`` on object storage (no rename), under
        NAME's lease: write the swap mark (``.vsekit/swaps/features/NAME.json``: the staged set and its
        generation), then :meth:`_finish_remote_replace`. From the mark on the swap is finished by this
        run, or by the next writer of NAME if this one is killed (docs/store.md, "Replacing a set")."""
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
        """Finish the swap the mark of ``name`` describes (under NAME's lease); returns the mark, or None
        without one. Every step can be done again, so a run killed here leaves the mark and the next
        writer of NAME calls this again (the steps: docs/store.md, "Replacing a set or a store on
        object storage")."""
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
                if c.startswith((f".{name}.partial-", f".{name}.{STAGED}")) and STAGING_NAME.match(c)]
        for child in gone:
            self._delete_remote_set(child)
        return gone


def finish_store_replace(objects: Any, holder: "FeatureStore") -> bool:
    """Swap in the complete nested store the mark ``.vsekit/swaps/store.json`` names (under the store's
    lease; False without a mark): the old store's objects go, but the nested store, the mark and the
    store's lease. Every step can be done again, and a run killed here leaves the mark (docs/store.md,
    "Replacing a set or a store on object storage")."""
    mark = objects.get_json(STORE_SWAP)
    if mark is None:
        return False
    staging = str(mark[0].get("staging") or "")
    src = f"{staging}/"
    meta = objects.get(src + "zarr.json")
    if not staging.startswith(".vsekit/next-") or meta is None:
        raise StoreError(f"{objects.url}: {STORE_SWAP} names a new store {staging!r} that is not there; "
                         f"delete {STORE_SWAP} and ingest again with --overwrite")
    # the old store's objects go, but the nested store, the mark and the lease this run holds
    swapped = swap_in(objects, [(src, "")], meta[0], step=lambda at: point(f"ingest:replace:{at}"),
                                check=lambda: holder.check_lease(STORE_LEASE),
                                keep=(src, STORE_SWAP, f".vsekit/leases/{STORE_LEASE}.json"), skip=(".vsekit/leases/",))
    if not swapped:
        raise StoreError(f"{objects.url}: another run created a store there meanwhile")
    point("ingest:replace:cleanup")
    objects.delete(STORE_SWAP)
    _delete_keys(objects, src)
    return True
