"""Creating (or reopening, to resume) the derived feature sets ``<name>.z`` and ``<name>.fne``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..storage import integrity
from ..storage.store import FAILED, FeatureSet, FeatureStore, ProvenanceError, config_hash, _jsonable

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
    return attrs


def existing_matches(store: FeatureStore, name: str, attrs: Mapping[str, Any], shape: tuple,
                     dtype: Any, block_rows: int, overwrite: bool) -> FeatureSet | None:
    """The existing set ``name`` if a rerun may resume it; None if absent (or to be overwritten).

    A set that exists with other settings is refused unless ``overwrite``.
    """
    if overwrite or not store.has_features(name):
        return None
    fs = FeatureSet(store, name)
    if "config_hash" not in fs.attrs:   # left half-made by an older vsekit that was killed: not started
        return None
    if (fs.attrs.get("config_hash") == attrs["config_hash"] and fs.shape == tuple(shape)
            and fs.data.dtype == np.dtype(dtype) and fs.chunk_rows == block_rows):
        return fs
    raise ProvenanceError(
        f"feature set {name!r} already exists in {store.path} with different settings "
        f"(config_hash {fs.attrs.get('config_hash')} != {attrs['config_hash']}, or another shape, "
        f"dtype or chunking); pass --overwrite to replace it or --name to write a new set")


def create(store: FeatureStore, name: str, parent: FeatureSet, width: int, dtype: Any,
           attrs: Mapping[str, Any], init: Callable[[FeatureSet], None] | None = None) -> FeatureSet:
    """A fresh derived set with the parent's row blocks (so one task reads one chunk and writes one).

    It replaces any set ``name`` only once it is complete (``init`` writes its statistics first).
    """
    return store.create_features(name, (width,), dtype, attrs=attrs, n_rows=parent.n_rows,
                                 block_rows=parent.chunk_rows, parent=parent.name, overwrite=True,
                                 init=init)


def copy_errors(parent: FeatureSet, child: FeatureSet) -> None:
    """Carry the parent's failure reasons over to the rows that stay failed in ``child``."""
    status = np.asarray(parent.status[:])
    errors = {r: f"failed in {parent.name}: {msg}" for r, msg in parent.errors().items()
              if 0 <= r < len(status) and status[r] == FAILED}
    missing = {int(r): f"failed in {parent.name}" for r in np.flatnonzero(status == FAILED)
               if int(r) not in errors}
    child.record_errors({**missing, **errors})


def pending_indices(fs: FeatureSet) -> frozenset:
    """The blocks still to write; damaged blocks (missing or truncated chunk files) count as pending."""
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
        return (f"{self.parent} -> {self.name}: {self.rows} rows ({self.failed_rows} failed kept failed)"
                f"{extra}; wrote {self.blocks_written} of {self.blocks_total} blocks"
                + (f" ({skipped} already done)" if skipped else ""))
