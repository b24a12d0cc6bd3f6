"""``standardize``: z = (x − μ) / σ per feature, μ and σ from one split's rows (FNE, Garcia-Gasulla et al. 2018, §3).

Statistics are the population mean and standard deviation (ddof = 0) over the rows of ``split``
(default ``train``) whose status is done; failed rows are left out and counted. A feature whose σ is
0 becomes 0 in every row of every split, as the public FNE code does (its ``np.divide(...,
where=std != 0)`` into zeros), and the set records how many there were. Unlike that code, which
holds all features in memory and takes statistics over whatever it is given, the statistics here
come from one split only and are merged block by block (see ``stats``). Statistics may come
from another store (``stats_from="STORE::NAME"``), e.g. train statistics for new images at
inference time; widths or tap layouts that differ are refused.

Writes ``<name>.z``: float32 (N, D) ``data``, ``status`` (failed parent rows stay failed), and
float64 ``mean``/``std`` and int64 ``count`` (D,) arrays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..storage.faults import point
from ..storage.splits import refuse_stale
from ..storage.store import FAILED, FeatureSet, FeatureStore, StoreError, write_array
from . import derived, passes
from . import stats as st
from .stats import SUB_ROWS


@dataclass(eq=False)
class Standardize:
    """The per-block transform: float64 arithmetic, float32 result, zero-σ features → 0."""

    mean: np.ndarray
    std: np.ndarray

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        live = self.std > 0
        scale = np.where(live, self.std, 1.0)
        out = np.empty(x.shape, np.float32)
        # a few rows at a time, so the float64 temporary stays in cache (twice as fast as whole blocks)
        buf = np.empty((min(SUB_ROWS, len(x)), x.shape[1]), np.float64)
        for i in range(0, len(x), SUB_ROWS):
            b = buf[:len(x[i:i + SUB_ROWS])]
            np.subtract(x[i:i + SUB_ROWS], self.mean, out=b)
            np.divide(b, scale, out=out[i:i + SUB_ROWS], casting="same_kind")
        if not live.all():
            out[:, ~live] = 0.0
        return out


@dataclass
class Stats:
    mean: np.ndarray
    std: np.ndarray
    count: np.ndarray
    source: str  # "split train" or "STORE::NAME"

    @property
    def zero_std(self) -> int:
        return int(np.sum(self.std == 0))


def check_source(parent: FeatureSet, *, allow_standardized: bool = False) -> None:
    """Standardisation applies to (N, D) numeric feature sets that are complete and not standardised
    already (``allow_standardized``: do it anyway)."""
    if len(parent.shape) != 2:
        raise StoreError(f"feature set {parent.name!r} has shape {parent.shape} (kind "
                         f"{parent.attrs.get('kind')!r}); standardize/discretize work on (N, D) sets")
    if parent.attrs.get("stage") == "discretize":
        raise StoreError(f"feature set {parent.name!r} holds ternary FNE codes (-1, 0, 1, made by discretize); "
                         f"standardizing codes makes no sense: standardize the float set they come from "
                         f"({parent.attrs.get('parent')!r} is their parent), or train on {parent.name!r} as it is")
    if parent.attrs.get("stage") == "standardize" and not allow_standardized:
        raise StoreError(f"feature set {parent.name!r} is standardized already (made by standardize from "
                         f"{parent.attrs.get('parent')!r}); standardizing it again makes "
                         f"{parent.name + '.z'!r} of values already z-scored: discretize it instead "
                         f"(`vsekit discretize --features {parent.name}`), or pass --allow-standardized "
                         f"to standardize it again on purpose")
    if parent.attrs.get("packed"):
        raise StoreError(f"feature set {parent.name!r} is 2-bit packed; it cannot be standardized")
    if not np.issubdtype(parent.data.dtype, np.number):
        raise StoreError(f"feature set {parent.name!r} has dtype {parent.data.dtype}, not numeric")
    parent.check(complete=True)


def parse_stats_from(spec: str) -> tuple[Path | str, str]:
    """``STORE::NAME`` → (the store: a path, or an object-store URL as it is; the set's name)."""
    from ..storage.objstore import is_object_url

    path, _, name = spec.rpartition("::")
    if not path or not name:
        raise ValueError(f"--stats-from {spec!r}: expected STORE::NAME (e.g. train.zarr::vgg19.z)")
    return (path if is_object_url(path) else Path(path)), name


def shown_spec(spec: str | None) -> str | None:
    """``--stats-from`` as it may be recorded: an object-store URL without any ``user:password@``."""
    from ..storage.objstore import is_object_url, public_url

    if spec is None or "::" not in spec:
        return spec
    path, name = spec.rsplit("::", 1)
    return f"{public_url(path)}::{name}" if is_object_url(path) else spec


def output_name(features: str, name: str | None = None) -> str:
    """The set ``standardize`` writes from ``features``: ``name``, else ``<features>.z``."""
    return name or f"{features}.z"


def load_stats(spec: str, parent: FeatureSet) -> Stats:
    """Statistics stored in another set (``NAME`` itself, or ``NAME.z``); refused if they do not fit ``parent``."""
    path, name = parse_stats_from(spec)
    other = FeatureStore.open(path, mode="r")
    src = other.features(name)
    if not (src.has_array("mean") and src.has_array("std")):
        alt = output_name(name)
        if other.has_features(alt) and other.features(alt).has_array("mean"):
            src = other.features(alt)
        else:
            raise StoreError(f"--stats-from {spec}: feature set {name!r} holds no mean/std arrays "
                             f"(standardize it first, or name its .z set)")
    if src.attrs.get("stats_ready") is False:
        raise StoreError(f"--stats-from {spec}: the statistics of {src.name!r} are not finished")
    mean = np.asarray(src.array("mean")[:], dtype=np.float64)
    std = np.asarray(src.array("std")[:], dtype=np.float64)
    count = (np.asarray(src.array("count")[:], dtype=np.int64) if src.has_array("count")
             else np.zeros(len(mean), np.int64))
    width = parent.shape[1]
    if mean.shape != (width,) or std.shape != (width,):
        raise StoreError(f"--stats-from {spec}: statistics have width {mean.shape[0]}, but feature set "
                         f"{parent.name!r} has width {width}")
    mine, theirs = parent.attrs.get("taps"), src.attrs.get("taps")
    if mine != theirs:
        raise StoreError(f"--stats-from {spec}: tap layout differs from feature set {parent.name!r} "
                         f"({_taps_text(theirs)} vs {_taps_text(mine)})")
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std >= 0)):
        raise StoreError(f"--stats-from {spec}: statistics contain non-finite or negative values")
    return Stats(mean, std, count, shown_spec(f"{path}::{src.name}"))


def _taps_text(taps: Any) -> str:
    if not taps:
        return "no taps"
    return ", ".join(f"{t.get('name')}[{t.get('start')}:{t.get('stop')}]" for t in taps)


def compute_stats(parent: FeatureSet, split: str, client: Any = None) -> tuple[Stats, dict]:
    """Scan ``parent`` once: statistics over the done rows of ``split``, and a finiteness check of all live rows."""
    store = parent.store
    status = np.asarray(parent.status[:])
    rows = store.split_rows(split) if store.n_images == parent.n_rows else None
    if rows is None:
        raise StoreError(f"feature set {parent.name!r} has {parent.n_rows} rows but the store has "
                         f"{store.n_images} images; cannot select split {split!r}")
    codes = passes.row_codes(status, rows)
    state = passes.scan(parent, codes, client)
    _refuse_nonfinite(parent, codes, state, client)
    mean, std, count = st.finalize(state)
    failed = int(np.sum(status[rows] == FAILED))
    used = int(count[0]) if len(count) else 0
    if used == 0:
        raise StoreError(f"split {split!r} has no done rows in feature set {parent.name!r} "
                         f"({len(rows)} rows in the split, {failed} failed); choose another --split")
    info = {"stats_rows": used, "stats_failed_excluded": failed}
    return Stats(mean, std, count, f"split {split}"), info


def _refuse_nonfinite(parent: FeatureSet, codes: np.ndarray, state: np.ndarray, client: Any) -> None:
    bad = state[st.BAD]
    if np.any(bad > 0):
        raise StoreError(passes.nonfinite_report(parent, codes, np.flatnonzero(bad > 0),
                                                 int(bad.sum()), client))


def prepare(store: FeatureStore, features: str, *, split: str = "train", stats_from: str | None = None,
            name: str | None = None, overwrite: bool = False, client: Any = None,
            pin: derived.Pin | None = None,
            allow_standardized: bool = False) -> tuple[FeatureSet, FeatureSet, Standardize, dict]:
    """Validate, compute (or reuse) statistics and create the ``.z`` set; no data blocks are written yet.

    ``pin``: the parent's generation when the stage began; statistics of a parent made again while
    they were computed are never written.
    """
    parent = store.features(features)
    refuse_stale(parent)
    pin = pin or derived.Pin.of(parent, "standardize")
    check_source(parent, allow_standardized=allow_standardized)
    out = output_name(features, name)
    attrs = derived.derived_attrs(parent, stage="standardize", split=None if stats_from else split,
                                  stats_from=shown_spec(stats_from), ddof=0, zero_std="zero", precision="fp32")
    width = parent.shape[1]
    fs = derived.existing_matches(store, out, attrs, parent.shape, np.float32, parent.chunk_rows, overwrite)
    if fs is not None and fs.attrs.get("stats_ready"):
        mean, std = np.asarray(fs.array("mean")[:]), np.asarray(fs.array("std")[:])
        info = {k: fs.attrs.get(k) for k in ("stats_rows", "stats_failed_excluded", "zero_std_features")}
        return parent, fs, Standardize(mean, std), info
    if stats_from:
        stats = load_stats(stats_from, parent)
        status = np.asarray(parent.status[:])
        codes = passes.row_codes(status, None)
        _refuse_nonfinite(parent, codes, passes.scan(parent, codes, client), client)
        info = {"stats_rows": int(stats.count.max()) if len(stats.count) else 0,
                "stats_failed_excluded": None}
    else:
        stats, info = compute_stats(parent, split, client)
    info["zero_std_features"] = stats.zero_std

    def init(staged: FeatureSet) -> None:  # the statistics are in the set before it appears
        point("standardize:stats")
        pin.check()   # the statistics come from the parent the stage began with
        write_array(staged.group, "mean", stats.mean)
        write_array(staged.group, "std", stats.std)
        write_array(staged.group, "count", stats.count)
        staged.update_attrs(stats_ready=True, stats_source=stats.source, **info)

    fs = derived.create(store, out, parent, width, np.float32, attrs, init=init)
    return parent, fs, Standardize(stats.mean, stats.std), info


def standardize(store: FeatureStore | str | os.PathLike, features: str, *, split: str = "train",
                stats_from: str | None = None, name: str | None = None, cluster: "ClusterSpec | str | None" = None,
                overwrite: bool = False, allow_standardized: bool = False) -> derived.Result:
    """Standardize feature set ``features`` into ``<features>.z`` (or ``name``); see the module docstring."""
    from ..clusters import cluster_client

    store = passes.open_store(store)
    cluster = store.sets.check_cluster(cluster, "standardize")   # on object storage: clusters that reach it
    with store.writer(output_name(features, name), stage="vsekit standardize", multi=bool(cluster)), cluster_client(cluster) as client:
        pin = derived.Pin.of(store.features(features), "standardize")
        parent, fs, fn, info = prepare(store, features, split=split, stats_from=stats_from, name=name,
                                       overwrite=overwrite, client=client, pin=pin,
                                       allow_standardized=allow_standardized)
        # the scan checked the values; each block is checked to come from the pinned parent
        (fs,), (written,) = passes.write_chain(store, parent, [(fs, fn)], client, pin, check=False)
    return derived.Result(fs.name, parent.name, fs.n_rows, fs.counts()["failed"], written, len(fs.blocks()),
                          {"split": None if stats_from else split, "stats_from": stats_from, **info})
