"""The commit protocol of a feature set on object storage, which has no rename and no lock file: a
block **committed** by one create-if-absent record ``.vsekit/commits/NAME/GENERATION/BLOCK.json``
(its chunks' CRC-32 and size, its rows' status) written right after the writer checked its lease
(:func:`write_record`); the status restored from the records (:func:`reconcile`); ``--repair``
voiding them (:func:`repair`); and the swaps (:func:`swap_in`, its POSIX twin :func:`swap_dir`).
Each promise and its test: docs/store.md, "The commit protocol next to the POSIX one".
"""

from __future__ import annotations

import json
import time
import zlib
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .base import PENDING, StoreError
from .faults import point
from .objstore import Objects, dumps, record_key

if TYPE_CHECKING:  # pragma: no cover
    from .store import Block, FeatureSet


def group_meta(attrs: dict) -> bytes:
    """A Zarr v3 group's ``zarr.json`` with ``attrs``."""
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}).encode()


def _objects(fs: "FeatureSet") -> Objects:
    return fs.store.objects


def chunk_key(fs: "FeatureSet", array: str, index: int) -> str:
    arr = fs.group[array]
    key = arr.metadata.encode_chunk_key((index,) + (0,) * (arr.ndim - 1))
    return f"features/{fs.name}/{array}/{key}"


def _sums(fs: "FeatureSet", block: "Block") -> dict[str, list[int]]:
    out = {}
    for name in fs.group.attrs.get("checksummed") or ["data"]:
        got = _objects(fs).get(chunk_key(fs, name, block.index))
        out[name] = [0, -1] if got is None else [zlib.crc32(got[0]) & 0xFFFFFFFF, len(got[0])]
    return out


def generation(fs: "FeatureSet") -> str:
    gen = fs.group.attrs.get("generation")
    if not gen:
        raise StoreError(f"feature set {fs.name!r} in {fs.store.path} has no generation attribute")
    return str(gen)


def _live(body: dict | None) -> bool:
    """A record that commits its block: not one a repair voided (:func:`repair`)."""
    return body is not None and "block" in body and not body.get("void")


def write_record(fs: "FeatureSet", block: "Block", status: np.ndarray) -> bool:
    """Commit ``block`` (its chunks are written): check the lease, then create its record, or replace a
    record a repair voided (compare-and-swap from the ETag just read). False when the block had a live
    record already (another writer committed it: this one leaves it alone)."""
    point("objstore:record")     # a kill here leaves the chunks written and the block uncommitted
    fs.store.check_lease(fs.target)
    body = dumps({"block": block.index, "start": block.start, "stop": block.stop,
                  "status": np.asarray(status, dtype=np.uint8).tolist(), "sums": _sums(fs, block),
                  "token": fs.store.lease_token, "time": time.time()})
    key = record_key(fs.name, generation(fs), block.index)
    if _objects(fs).create(key, body) is not None:
        return True
    got = _objects(fs).get_json(key)
    if got is None or _live(got[0]) or not got[1]:
        return False
    return _objects(fs).swap(key, body, got[1]) is not None


def read_record(fs: "FeatureSet", index: int) -> dict | None:
    """The live commit record of block ``index``, or None."""
    got = _objects(fs).get_json(record_key(fs.name, generation(fs), index))
    return got[0] if got is not None and _live(got[0]) else None


def records(fs: "FeatureSet", etags: dict[int, str | None] | None = None) -> dict[int, dict]:
    """Every live commit record of ``fs``'s generation, by block index (``etags``: filled with each
    one's ETag, for a repair that must not void a record written after it looked)."""
    objects, gen = _objects(fs), generation(fs)
    out = {}
    for key in objects.keys(f".vsekit/commits/{fs.name}/{gen}/"):
        got = objects.get_json(key)
        if got is not None and _live(got[0]):
            out[int(got[0]["block"])] = got[0]
            if etags is not None:
                etags[int(got[0]["block"])] = got[1]
    return out


def committed(fs: "FeatureSet", block: "Block") -> bool:
    """Whether ``block`` has its commit record (a dask task asks before computing and before writing)."""
    return read_record(fs, block.index) is not None


def reconcile(fs: "FeatureSet") -> int:
    """Restore the status of blocks whose record exists but whose status chunk was not written (a
    writer killed between the two); returns how many. Run under the set's lease."""
    status = np.asarray(fs.status[:])
    blocks = fs.blocks()
    objects, gen = _objects(fs), generation(fs)
    fixed = 0
    # one listing; a record is read only for a block whose status is still pending (the rare case)
    for key in objects.keys(f".vsekit/commits/{fs.name}/{gen}/"):
        stem = key.rsplit("/", 1)[-1][:-len(".json")]
        if not stem.isdigit() or int(stem) >= len(blocks):
            continue
        b = blocks[int(stem)]
        if not np.any(status[b.start:b.stop] == PENDING):
            continue
        got = objects.get_json(key)
        if got is None or not _live(got[0]):
            continue
        want = np.asarray(got[0].get("status", []), dtype=np.uint8)
        if len(want) == len(b):
            fs.status[b.start:b.stop] = want
            fixed += 1
    return fixed


def repair(fs: "FeatureSet", report) -> int:
    """Mark damaged blocks pending, so a rerun commits them again. A record is never deleted: the repair
    voids it by compare-and-swap from the ETag ``info --verify`` saw, keeping its body (the rerun's record
    replaces the void one the same way). A record that changed since the check (another writer's) is
    left as it is, and so is its block. Its callers hold the set's lease; returns the blocks marked pending."""
    blocks = fs.blocks()
    etags = report.etags
    marked = 0
    for i in sorted(report.damaged):
        key = record_key(fs.name, generation(fs), i)
        if i in etags:
            got = _objects(fs).get_json(key)
            void = dumps({"void": True, "record": got[0] if got else None, "reason": report.damaged[i],
                          "by": fs.store.lease_token, "time": time.time()})
            if got is None or got[1] != etags[i] or _objects(fs).swap(key, void, etags[i]) is None:
                continue
        b = blocks[i]
        fs.status[b.start:b.stop] = np.zeros(len(b), dtype=np.uint8)
        marked += 1
    return marked


def swap_dir(staging, final, *, trash=None, step: Callable[[], None] = lambda: None) -> None:
    """The POSIX twin of :func:`swap_in`: rename the complete folder ``staging`` to ``final``, an old
    ``final`` moved aside first (to ``trash``, default ``.FINAL.old-*`` beside it) and removed after.
    ``step()`` runs between the two renames (the caller's fault point). A kill leaves the old or the new
    folder in place and at most a hidden leftover, which the next writer removes."""
    import shutil
    import uuid

    old = None
    if final.exists():
        old = trash or final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    step()
    staging.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def swap_in(objects: Objects, moves: Sequence[tuple[str, str]], meta: bytes, *, step: Callable[[str], None],
            check: Callable[[], None], keep: Sequence[str] = (), skip: Sequence[str] = ()) -> bool:
    """Replace what is under each ``dst`` by what is under its ``src`` on object storage, which has no
    rename: the one swap of a feature set, a whole store and the tokens (docs/store.md, "Replacing a
    set or a store on object storage"). ``moves[0]`` is the group published by its ``zarr.json``
    (written last, by create-if-absent, with ``meta``); the other pairs move along with it (a set's
    commit records). Before each step ``step(name)`` is called (the caller's fault point:
    ``unpublish``, ``delete``, ``copy``, ``publish``) and then ``check()`` (the caller's lease: a run
    that lost it stops before the next destructive request). The old group's ``zarr.json`` goes
    first, so no reader lists it until the new one is whole; keys starting with one of ``keep`` are
    not deleted, source keys whose rest starts with one of ``skip`` not copied. Every step can be
    done again, so a run killed anywhere leaves its caller's swap mark and the next run calls this
    again. False: the ``zarr.json`` was created meanwhile by another run."""
    group = moves[0][1]
    step("unpublish")
    check()
    objects.delete(group + "zarr.json")
    step("delete")
    check()
    for _, dst in moves:
        for key in objects.keys(dst):
            if not key.startswith(tuple(keep)):
                objects.delete(key)
    step("copy")
    check()
    for src, dst in moves:
        for key in objects.keys(src):
            rest = key[len(src):]
            if (src, dst) == moves[0] and rest == "zarr.json" or rest.startswith(tuple(skip)):
                continue
            objects.copy(key, dst + rest)
    step("publish")
    check()
    return objects.create(group + "zarr.json", meta) is not None
