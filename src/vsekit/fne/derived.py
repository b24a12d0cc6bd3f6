"""Creating (or reopening, to resume) the derived feature sets ``<name>.z`` and ``<name>.fne``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..storage import integrity, remake
from ..words import plural
from ..storage.store import (FAILED, FeatureSet, FeatureStore, ProvenanceError, StoreError, _jsonable,
                             config_hash, read_generation)

#: Parent attrs a derived set carries over (the shared schema: kind and taps, plus model provenance).
INHERITED = ("kind", "model", "weights", "taps", "layers", "crops")


def derived_attrs(parent: FeatureSet, **config: Any) -> dict[str, Any]:
    """Provenance of a set derived from ``parent`` with ``config``; includes its ``config_hash``."""
    pa = parent.attrs
    attrs = {k: pa[k] for k in INHERITED if k in pa}
    attrs["parent_config_hash"] = pa.get("config_hash")
    attrs.update(config)
    attrs = _jsonable(attrs)
    attrs["config_hash"] = config_hash(attrs)
    attrs["parent_generation"] = pa.get("generation")   # which making of the parent (not a setting)
    return attrs


class ParentChanged(StoreError):
    """The parent set was made again (``--overwrite``) while a derived stage was reading it."""


@dataclass(frozen=True)
class Pin:
    """The generation of the parent set when a derived stage began reading it (picklable for dask).

    :meth:`check` is called after each block is read and before its output is written, after the
    statistics are computed and before the set is committed: a parent made again meanwhile stops the
    stage before anything computed from two different parents is written.
    """

    store: str
    name: str
    generation: str | None
    stage: str
    # object storage: the URL's options, for a task in another process (in memory, never shown)
    options: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, parent: FeatureSet, stage: str) -> "Pin":
        return cls(str(parent.store.path), parent.name, parent.generation, stage, parent.store.sets.options())

    def _now(self) -> str | None:
        from ..storage.objstore import is_object_url, objects_for

        if is_object_url(self.store):   # object storage: the set's published zarr.json
            got = objects_for(self.store, self.options).get_json(f"features/{self.name}/zarr.json")
            return "absent" if got is None else (got[0].get("attributes") or {}).get("generation")
        return read_generation(self.store, self.name)

    def check(self) -> None:
        if self._now() != self.generation:
            raise ParentChanged(
                f"feature set {self.name!r} in {self.store} was made again (--overwrite) while {self.stage} "
                f"was reading it; nothing was written from it. Run {self.stage} again once it is finished")


def drop(store: FeatureStore, fs: FeatureSet, exc: BaseException) -> None:
    """After a stage failed with ``exc``: drop a staged set (what it would have replaced stays), and
    a set this run created from a parent that changed (:class:`ParentChanged`). A set resumed or
    created by a run stopped for another reason stays, so the rerun resumes it."""
    if fs.staged:
        store.discard(fs)
    elif getattr(fs, "made_here", False) and isinstance(exc, ParentChanged):
        store.delete_features(fs.name)


def existing_matches(store: FeatureStore, name: str, attrs: Mapping[str, Any], shape: tuple,
                     dtype: Any, block_rows: int, overwrite: bool) -> FeatureSet | None:
    """The existing set ``name`` if a rerun may resume it; None if absent (or to be overwritten).

    A set that exists with other settings is refused unless ``overwrite``.
    """
    if overwrite or not store.has_features(name):
        return None
    fs = FeatureSet(store, name)
    changed = fs.settings_changed(attrs, shape, dtype, block_rows)
    if changed:
        raise ProvenanceError(changed)
    if fs.attrs.get("stale"):   # a re-split changed the rows its statistics (or its parent's) came from
        raise ProvenanceError(
            f"feature set {name!r} in {store.path} is stale: {fs.attrs['stale']}; pass --overwrite to "
            f"make it again")
    made_from = fs.attrs.get("parent_generation")
    if made_from is not None and made_from != attrs.get("parent_generation"):
        raise ProvenanceError(
            f"feature set {name!r} in {store.path} was made from an earlier {fs.attrs.get('parent')!r} "
            f"(made again since); pass --overwrite to make it from the current one")
    return fs


def create(store: FeatureStore, name: str, parent: FeatureSet, width: int, dtype: Any,
           attrs: Mapping[str, Any], init: Callable[[FeatureSet], None] | None = None) -> FeatureSet:
    """A fresh derived set with the parent's row blocks (so one task reads one chunk and writes one).

    A new set appears complete (``init`` writes its statistics first); one that replaces an existing
    set is built beside it (``fs.staged``) and swapped in by the caller's ``store.commit`` at the end.
    """
    fs = store.create_features(name, (width,), dtype, attrs=attrs, n_rows=parent.n_rows,
                               block_rows=parent.chunk_rows, parent=parent.target, overwrite=True,
                               init=init, beside=True)
    fs.made_here = True
    return fs


def copy_errors(parent: FeatureSet, child: FeatureSet) -> None:
    """Carry the parent's failure reasons over to the rows that stay failed in ``child``."""
    status = np.asarray(parent.status[:])
    errors = {r: f"failed in {parent.name}: {msg}" for r, msg in parent.errors().items()
              if 0 <= r < len(status) and status[r] == FAILED}
    missing = {int(r): f"failed in {parent.name}" for r in np.flatnonzero(status == FAILED)
               if int(r) not in errors}
    child.record_errors({**missing, **errors})


def pending_indices(fs: FeatureSet) -> frozenset:
    """The blocks still to write; damaged blocks (missing or truncated chunk files) count as pending.
    On object storage a block with its commit record but no status yet (a writer killed between the
    two) gets its status from the record first: it is done, never written twice."""
    fs.store.sets.reconcile(fs)
    report = integrity.verify(fs, quick=True)
    if report.damaged:
        integrity.repair(fs, report)
    return frozenset(b.index for b in fs.pending_blocks())


@dataclass
class Result:
    """What a stage did: the set written, its parent, and how much work was done or skipped."""

    name: str
    parent: str
    rows: int
    failed_rows: int
    blocks_written: int
    blocks_total: int
    details: dict = field(default_factory=dict)

    def summary(self) -> str:
        skipped = self.blocks_total - self.blocks_written
        extra = "".join(f", {k.replace('_', ' ')} {v}" for k, v in self.details.items() if v is not None)
        if self.details.get("zero_std_features"):
            extra += (" (features constant over the statistics rows, e.g. units that never fire on so few "
                      "images: their z is 0)")
        return (f"{self.parent} -> {self.name}: {self.rows} rows"
                f"{f' ({self.failed_rows} failed in the parent, left failed)' if self.failed_rows else ''}"
                f"{extra}; wrote {self.blocks_written} of {plural(self.blocks_total, 'block')}"
                + (f" ({skipped} already done)" if skipped else ""))


def _remake_args(store_path: str, name: str, a: Mapping[str, Any]) -> list[str]:
    """The command that makes a standardized or discretized set again, from its attrs."""
    stage = a["stage"]
    args = ["vsekit", stage, "--store", store_path, "--features", a["parent"]]
    if stage == "standardize":
        if a.get("stats_from"):
            args += ["--stats-from", a["stats_from"]]
        elif a.get("split"):
            args += ["--split", a["split"]]
    else:
        args += ["--thresholds", *(str(t) for t in a.get("thresholds", []))]
        if a.get("packed"):
            args.append("--pack")
    return [*args, "--name", name]


for _stage in ("standardize", "discretize"):
    remake.register(_stage, lambda a, _s=_stage: a.get("stage") == _s and bool(a.get("parent")), _remake_args)
