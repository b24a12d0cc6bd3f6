"""Feature sets and whole stores on object storage (no rename): creating, publishing, opening and
replacing them (docs/store.md, "Stores on object storage", "Replacing a set or a store on object
storage"), and their guards: :class:`ObjectSets`, the object-storage :class:`~.sets.SetStorage`."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import zarr
import zarr.storage

from . import objcommit
from .base import STAGED, STAGING_NAME, STORE_GUARD, Block, ProvenanceError, StoreError, not_a_store
from .faults import point
from .integrity import Report
from .leases import JointLease, default_ttl, free_reason
from .meta import check_format, refuse_dropping, root_attrs, settings_diff
from .objcommit import group_meta, swap_in
from .objstore import (TOKENS_SWAP, LeaseObject, Objects, SetLease, dumps, lease_key,
                       parse_options, require_conditions)
from .sets import SetStorage

if TYPE_CHECKING:  # pragma: no cover
    from .store import FeatureSet, FeatureStore

STORE_LEASE = STORE_GUARD   # the whole store's lease on object storage
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



# --- whole stores: created, opened, built by an ingest, replaced (FeatureStore's classmethods call these)
def create_store(cls: type, url: str, storage_options: Any, *, dataset: str, image_root: Any,
                 source_files: Sequence[str], overwrite: bool) -> "FeatureStore":
    """A new store at an object-store URL: its root ``zarr.json`` created with create-if-absent (one
    ingest per URL), ``complete: false`` until the ingest finishes (:func:`building_store`)."""
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


def open_store(cls: type, url: str, mode: str, storage_options: Any) -> "FeatureStore":
    objects = Objects(url, parse_options(storage_options))
    got = objects.get_json("zarr.json")
    if got is None:   # a store's objects are deleted only after its zarr.json (finish_store_replace)
        refuse_if_store_replaced(objects)
        raise StoreError(not_a_store(objects.url))
    attrs = got[0].get("attributes") or {}
    check_format(objects.url, attrs)
    if attrs.get("complete") is False:
        raise StoreError(f"{objects.url}: its ingest has not finished (or was killed before it did); rerun "
                         f"the ingest into a new URL, or delete these objects and ingest again")
    root = zarr.open_group(objects.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3)
    return cls(root, objects.url, objects)


@contextlib.contextmanager
def building_store(cls: type, url: str, *, overwrite: bool, drop_features: bool = False,
                   **create_kw: Any) -> Iterator["FeatureStore"]:
    """An ingest into an object-store URL: the store's root is created first (create-if-absent: one
    ingest per URL) and marked complete last; a failed ingest deletes what it wrote. An existing
    store is replaced only with ``overwrite`` (:func:`_replacing_store`)."""
    objects = Objects(url, parse_options(create_kw.get("storage_options")))
    if overwrite and (objects.get("zarr.json") is not None or objects.get(STORE_SWAP) is not None):
        with _replacing_store(cls, objects, drop_features=drop_features, **create_kw) as store:
            yield store
        return
    store = cls.create(url, **create_kw)
    with _ingesting(store, store.objects, ""):
        yield store


@contextlib.contextmanager
def _replacing_store(cls: type, objects: Any, *, drop_features: bool, **create_kw: Any) -> Iterator["FeatureStore"]:
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


class ObjectSets(SetStorage):
    """The feature sets of a store on object storage (``store.objects``): leases guard them, a set is
    published by create-if-absent, a block committed by its record (:mod:`.objcommit`), a set
    replaced by a marked, lease-checked copy the next writer finishes (:meth:`swap`)."""

    remote = True
    guard = "lease"
    chunk_word = "object"

    @property
    def objects(self) -> Objects:
        return self.store.objects

    @property
    def path(self) -> str:
        return self.store.path

    def options(self) -> dict[str, str]:
        return dict(self.objects.options)

    def task_path(self) -> str:
        return self.path

    def check_cluster(self, cluster: Any, what: str, arrays: bool = False) -> Any:
        """Refuse ``cluster`` for ``what`` (a stage), in one line, where its workers cannot reach this
        store; returns the parsed spec. ``arrays``: the stage serves ``slurm-array:N`` / ``sge-array:N``
        here (extraction: extract/array.py)."""
        from ..clusters import OBJECT_STORAGE_ARRAYS, OBJECT_STORAGE_KINDS, parse_cluster

        spec = parse_cluster(cluster)
        if spec is None:
            return None
        if self.path.startswith("memory://"):
            raise StoreError(f"--cluster {spec}: a memory:// store lives in this process only, where no worker "
                             f"process can reach it; run without --cluster")
        served = OBJECT_STORAGE_KINDS + (OBJECT_STORAGE_ARRAYS if arrays else ())
        if spec.kind not in served:
            kinds = " / ".join(("tcp://" if k == "tcp" else f"{k}:N") for k in served)
            raise StoreError(f"--cluster {spec}: {what} into a store on object storage ({self.path}) runs "
                             f"in-process or on --cluster {kinds} for now (issue 35); run it with one of those")
        return spec

    # the guards ------------------------------------------------------------------------------------
    def holds(self, name: str, token: str | None) -> bool:
        """Read, not renewed: the lease holds ``token`` for a third of its ttl more (a dask task checks
        its driver's lease so; only the driver renews it). No token: nothing may be committed."""
        got = None if token is None else LeaseObject(self.objects, lease_key(name)).read()
        return (got is not None and got[0].get("token") == token
                and time.time() + float(got[0].get("ttl") or default_ttl()) / 3 < got[2])

    def token(self, name: str) -> str | None:
        return self.store.lease_token

    @contextlib.contextmanager
    def writer(self, names: tuple[str, ...], stage: str, multi: bool) -> Iterator[None]:
        """The sets' leases (on a provider that ignores conditional writes every writer is refused
        unless the user says it is the only one: :func:`~.objstore.require_conditions`)."""
        store = self.store
        require_conditions(self.objects, f"{stage} with more than one writer" if multi else stage, multi=multi)
        taken = []
        # one token for the leases this run holds at once (its dask tasks carry it and commit any of its
        # sets); a fresh one for a run that holds none, so tasks of an earlier run never commit for it
        token = next(iter(store.leases.values())).token if store.leases else uuid.uuid4().hex
        try:
            for name in sorted(set(names) - set(store.leases)):   # sorted: two runs never deadlock
                lease = SetLease(self.objects, name, stage, token=token).acquire()
                store.leases[name] = lease
                taken.append(lease)
                store.lease_token = lease.token
            if taken and STORE_LEASE not in names:
                self.refuse_if_store_held()
            for lease in taken:   # a replacement of a set a killed run left half-done: finished first
                if lease.name != STORE_LEASE:
                    mark = self.finish_swap(lease.name)
                    if mark:
                        store.finished_swaps[lease.name] = mark
            yield
        finally:
            for lease in taken:
                store.leases.pop(lease.name, None)
                lease.release()

    def hand_over(self, name: str, token: str, extra: dict) -> Any:
        """The set's lease rewritten (compare-and-swap) as the array's, ``pid: 0`` so that this process
        ending does not free it; the tasks renew it jointly (:meth:`join`)."""
        lease = self.store.leases[name]
        own = lease.token
        lease.hand_over(token, {"pid": 0, "host": None, **extra})

        def back() -> None:
            with contextlib.suppress(StoreError):
                lease.hand_over(own, {}, handed=False)
        return back

    def join(self, name: str, token: str, ttl: float) -> JointLease:
        lease = JointLease(LeaseObject(self.objects, lease_key(name)),
                           f"the lease of feature set {name!r} in {self.path}", token, ttl)
        self.store.leases[name] = lease   # every commit record checks it (check_lease)
        self.store.lease_token = token
        return lease

    def live(self, name: str) -> tuple[dict, float] | None:
        got = LeaseObject(self.objects, lease_key(name)).read()
        return None if got is None or free_reason(got[0], got[2]) is not None else (got[0], got[2])

    def guard_names(self) -> list[str]:
        return [k.rsplit("/", 1)[-1][:-len(".json")] for k in self.objects.keys(".vsekit/leases/") if k.endswith(".json")]

    # a set's life ----------------------------------------------------------------------------------
    def generation(self, name: str) -> str | None:
        got = self.objects.get_json(f"features/{name}/zarr.json")
        return "absent" if got is None else (got[0].get("attributes") or {}).get("generation")

    def staged(self, name: str) -> bool:
        self.refuse_if_replacing(name)
        return bool(STAGING_NAME.match(name)) and self.objects.get(f"features/{name}/zarr.json") is not None

    def create(self, name: str, spec: tuple, *, replace: bool, beside: bool) -> "FeatureSet":
        store = self.store
        held = store._new_store_leases
        if held is not None and name not in store.leases:   # a set of a store its ingest is building
            held.enter_context(store.writer(name, stage="vsekit ingest"))
        if not replace:
            return self._publish(name, spec)
        staging = f".{name}.{STAGED}{uuid.uuid4().hex[:8]}"   # built beside it, swapped in by commit()
        self._publish(staging, spec)
        fs = store.feature_set(staging, target=name)
        return fs if beside else store.commit(fs)

    def _publish(self, name: str, spec: tuple) -> "FeatureSet":
        """A new set: its arrays' metadata written where the set lives, then the set published by one
        create-if-absent of its ``zarr.json`` (storage/objcommit.py). A set published meanwhile by
        another run is compared by its settings hash: reopened, or refused."""
        mem = zarr.open_group(zarr.storage.MemoryStore(), mode="w", zarr_format=3)
        self.store._build(mem.create_group("set"), name, *spec)
        attrs = spec[-2]
        self.store.root.require_group("features")
        meta = None
        for key, buf in sorted(mem.store._store_dict.items()):
            if not key.startswith("set/"):
                continue
            if key == "set/zarr.json":
                meta = json.loads(buf.to_bytes())
                continue
            self.objects.put(f"features/{name}/{key[4:]}", buf.to_bytes())
        point("create_features:publish")
        if self.objects.create(f"features/{name}/zarr.json", group_meta(meta["attributes"])) is None:
            have = (self.objects.get_json(f"features/{name}/zarr.json") or ({}, None))[0].get("attributes") or {}
            if have.get("config_hash") != attrs.get("config_hash"):
                raise ProvenanceError(
                    f"feature set {name!r} was just created in {self.path} by another run with different "
                    f"settings ({'; '.join(settings_diff(have, attrs)) or 'another vsekit version'}); "
                    f"pass --name to write a new set")
        return self.store.feature_set(name)

    def swap(self, name: str, staging: str) -> None:
        """Swap the complete hidden set ``staging`` in as ``name`` (no rename here), under NAME's lease:
        write the swap mark (``.vsekit/swaps/features/NAME.json``: the staged set and its generation),
        then :meth:`finish_swap`. From the mark on the swap is finished by this run, or by the next
        writer of NAME if this one is killed (docs/store.md, "Replacing a set")."""
        got = self.objects.get_json(f"features/{staging}/zarr.json")
        if got is None:
            raise StoreError(f"feature set {staging!r} in {self.path} is gone; it cannot replace {name!r}")
        self.check_lease(name)
        point("replace:mark")
        self.objects.put(replace_mark(name), dumps({
            "staging": staging, "generation": (got[0].get("attributes") or {}).get("generation"),
            "new": not self.store.has_features(name), "token": self.store.lease_token}))
        self.finish_swap(name)

    def finish_swap(self, name: str) -> dict | None:
        """Finish the swap the mark of ``name`` describes, under NAME's lease (:func:`finish_marked`)."""
        return finish_marked(self.objects, replace_mark(name), lambda staging: [
            (f"features/{staging}/", f"features/{name}/"), (f".vsekit/commits/{staging}/", f".vsekit/commits/{name}/")],
            f"feature set {name!r}", f"run the command that makes {name!r} again with --overwrite", "replace",
            check=lambda: self.check_lease(name))

    def refuse_if_replacing(self, name: str) -> None:
        """One clear error while feature set ``name`` is being replaced (its swap mark is there): a
        reader never gets a mix of the old and the new set, or fill values for the old set's deleted
        chunks."""
        if self.objects.get_json(replace_mark(name)) is None:
            return
        raise StoreError(f"feature set {name!r} in {self.path} is being replaced (an --overwrite is swapping "
                         f"the new set in, or one was killed while it did); wait for it to finish, or if it "
                         f"was killed, run any command that writes {name!r} (the same one with --overwrite): "
                         f"it finishes the swap first")

    def discard(self, fs: "FeatureSet") -> None:
        if self.objects.get(replace_mark(fs.target)) is None:   # never one a swap mark names
            self._delete(fs.name)

    def _delete(self, name: str) -> None:
        """Delete every object of the (hidden) set ``name``: its zarr.json first, so it is listed by no
        reader from then on, then its arrays and its commit records."""
        self.objects.delete(f"features/{name}/zarr.json")
        for prefix in (f"features/{name}/", f".vsekit/commits/{name}/"):
            for key in self.objects.keys(prefix):
                self.objects.delete(key)

    def remove_leftovers(self, name: str) -> list[str]:
        """The hidden ``.NAME.partial-*`` / ``.NAME.next-*`` sets killed runs left, deleted only under
        NAME's lease (after a half-done swap is finished: no live run builds one then)."""
        if name not in self.store.leases:
            return []
        gone = [c for c in self.objects.children("features/")
                if c.startswith((f".{name}.partial-", f".{name}.{STAGED}")) and STAGING_NAME.match(c)]
        for child in gone:
            self._delete(child)
        return gone

    # a block's records -----------------------------------------------------------------------------
    def may_write(self, fs: "FeatureSet", block: Block) -> bool:
        return not objcommit.committed(fs, block)   # committed already: its chunks are never written again

    def commit_block(self, fs: "FeatureSet", block: Block, status: Any) -> bool:
        return objcommit.write_record(fs, block, status)   # False: committed by another writer first

    def committed(self, fs: "FeatureSet", block: Block) -> bool:
        return objcommit.committed(fs, block)

    def reconcile(self, fs: "FeatureSet") -> int:
        return objcommit.reconcile(fs)

    def recorded(self, fs: "FeatureSet", etags: dict | None = None) -> Any:
        recs = objcommit.records(fs, etags)   # one listing of the generation's commit records

        def at(index: int) -> Any:
            rec = recs.get(index)
            if rec is None:
                return "its rows are finished but it has no commit record"
            return {name: (int(c), int(n)) for name, (c, n) in rec.get("sums", {}).items()}
        return at

    def chunk_sum(self, fs: "FeatureSet", array: str, index: int, crc: bool) -> tuple[int, int]:
        got = self.objects.get(objcommit.chunk_key(fs, array, index))
        return (0, -1) if got is None else (zlib.crc32(got[0]) & 0xFFFFFFFF if crc else 0, len(got[0]))

    def repair(self, fs: "FeatureSet", report: Any) -> int:
        return objcommit.repair(fs, report)

    def reopen(self, fs: "FeatureSet", indices: list[int]) -> None:
        """A committed block is never written again: its record is voided (as a repair does, which
        marks the whole block pending: the caller writes the rows it keeps back)."""
        report = Report(fs.name, len(fs.blocks()))
        objcommit.records(fs, report.etags)
        report.damaged = {i: "retrying its failed rows" for i in indices}
        objcommit.repair(fs, report)

    def replace_array(self, key: str, values: Any) -> None:
        """No rename here: the array's chunks are put in place (docs/store.md, "vsekit split")."""
        self.store.root[key][:] = values

    def swaps(self) -> tuple[bool, list[str]]:
        """Whether a tokenize is swapping the tokens in, and the sets an --overwrite is swapping in (or
        a killed one left half-swapped), for ``vsekit info``."""
        prefix = ".vsekit/swaps/features/"
        return (self.objects.get(TOKENS_SWAP) is not None,
                sorted(k[len(prefix):-len(".json")] for k in self.objects.keys(prefix) if k.endswith(".json")))

    # tokens ----------------------------------------------------------------------------------------
    def swap_group(self, staging: str, dst: str, guard: str, fault: str) -> None:
        """Write the swap mark (``.vsekit/swaps/DST.json``): from it on, the swap is finished by
        whichever run comes next (this one, or the next writer of ``dst`` if this one is killed)."""
        self.objects.put(f".vsekit/swaps/{dst}.json", dumps({"staging": staging, "token": self.store.lease_token}))
        self.finish_group_swap(dst, guard, fault)

    def finish_group_swap(self, dst: str, guard: str, fault: str) -> None:
        """Replace ``dst/`` by the complete staged group the mark names, under ``guard``'s lease: readers
        see the old group, then none, then the new one (:func:`finish_marked`;
        ``tests/test_objstore_ingest.py::test_a_tokenize_killed_in_its_swap_on_s3_leaves_old_or_no_tokens_and_the_next_one_finishes_it``)."""
        finish_marked(self.objects, f".vsekit/swaps/{dst}.json", lambda staging: [(f"{staging}/", f"{dst}/")],
                      dst, "run it again", fault, check=lambda: self.check_lease(guard))


def finish_marked(objects: Any, mark_key: str, moves: Callable[[str], list[tuple[str, str]]], what: str,
                  redo: str, fault: str, check: Callable[[], None], keep: Sequence[str] = (),
                  skip: Sequence[str] = ()) -> dict | None:
    """The one finisher of every swap on object storage (a feature set's, the tokens', a whole store's):
    the complete staged group that the mark ``mark_key`` names is put in place by :func:`.objcommit.swap_in`
    (``moves(staging)``: its pairs, the group first), then the mark goes, then the staged objects.
    Every step can be done again, so a run killed anywhere leaves the mark and the next writer of
    ``what`` calls this again (docs/store.md, "Replacing a set or a store on object storage").
    Returns the mark, or None without one."""
    mark = objects.get_json(mark_key)
    if mark is None:
        return None
    pairs = moves(str(mark[0].get("staging") or ""))
    meta = objects.get(pairs[0][0] + "zarr.json")
    if meta is None:
        raise StoreError(f"{objects.url}: the new {what} a killed run was swapping in is gone; delete "
                         f"{mark_key} and {redo}")
    if not swap_in(objects, pairs, meta[0], step=lambda at: point(f"{fault}:{at}"), check=check,
                   keep=(*(src for src, _ in pairs), *keep), skip=skip):
        raise StoreError(f"{objects.url}: another run published {what} meanwhile")
    point(f"{fault}:cleanup")
    objects.delete(mark_key)
    for src, _ in pairs:
        _delete_keys(objects, src)
    return mark[0] or {"finished": True}


def finish_store_replace(objects: Any, holder: "FeatureStore") -> bool:
    """Swap in the complete nested store the mark ``.vsekit/swaps/store.json`` names, under the store's
    lease (:func:`finish_marked`; False without a mark): the old store's objects go, but the nested
    store, the mark and the store's lease."""
    return finish_marked(objects, STORE_SWAP, lambda staging: [(f"{staging}/", "")], "store",
                         "ingest again with --overwrite", "ingest:replace", lambda: holder.check_lease(STORE_LEASE),
                         keep=(STORE_SWAP, f".vsekit/leases/{STORE_LEASE}.json"),
                         skip=(".vsekit/leases/",)) is not None
