"""``discretize``: the FNE's ternary feature discretisation (Garcia-Gasulla et al. 2018, §3; Vilalta et al.).

z > hi → 1, z < lo → −1, otherwise 0, with strict inequalities (a value equal to a threshold maps
to 0). The papers' thresholds are lo = −0.25 and hi = 0.15. Thresholds are compared in the stored
values' own dtype (float32 for ``.z`` sets), so a value written as 0.15 is "equal to 0.15".
Output ``<name>.fne``: int8 (N, D), or with ``pack`` 2-bit codes, 4 features per byte (uint8
(N, ceil(D/4)), attrs ``packed: true`` and ``n_features``; read back with :func:`vsekit.fne.unpack`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..storage.splits import refuse_stale
from ..storage.store import FeatureSet, FeatureStore, StoreError
from . import derived, passes
from .pack import pack, packed_width

DEFAULT_THRESHOLDS = (-0.25, 0.15)


@dataclass(eq=False)
class Discretize:
    lo: float
    hi: float
    packed: bool = False

    def __call__(self, z: np.ndarray) -> np.ndarray:
        z = np.asarray(z)
        kind = z.dtype.type if np.issubdtype(z.dtype, np.floating) else np.float64
        q = (z > kind(self.hi)).astype(np.int8) - (z < kind(self.lo)).astype(np.int8)
        return pack(q) if self.packed else q


def check_thresholds(thresholds: Sequence[float]) -> tuple[float, float]:
    if len(thresholds) != 2:
        raise ValueError(f"--thresholds expects two values LO HI, got {list(thresholds)}")
    lo, hi = (float(t) for t in thresholds)
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        raise ValueError(f"--thresholds {lo} {hi}: expected finite LO <= HI (the papers use -0.25 0.15)")
    return lo, hi


def output_name(features: str, name: str | None = None) -> str:
    """The set ``discretize`` writes from ``features``: ``name``, else ``<features>.fne``."""
    return name or f"{features}.fne"


def prepare(store: FeatureStore, features: str, *, thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
            pack_bits: bool = False, name: str | None = None, overwrite: bool = False,
            parent: FeatureSet | None = None, allow_raw: bool = False) -> tuple[FeatureSet, Discretize]:
    """Validate and create (or reopen) the ``.fne`` set of ``features``."""
    lo, hi = check_thresholds(thresholds)
    parent = parent or store.features(features)
    if len(parent.shape) != 2:
        raise StoreError(f"feature set {parent.name!r} has shape {parent.shape}; discretize works on (N, D) sets")
    if parent.attrs.get("packed") or not np.issubdtype(parent.data.dtype, np.floating):
        raise StoreError(f"feature set {parent.name!r} has dtype {parent.data.dtype}"
                         f"{' (packed)' if parent.attrs.get('packed') else ''}; discretize needs float "
                         f"values (standardize first)")
    check_standardized(parent, allow_raw)
    out = output_name(features, name)
    width = parent.shape[1]
    config = dict(stage="discretize", thresholds=[lo, hi], packed=bool(pack_bits), values=[-1, 0, 1])
    if pack_bits:
        config.update(n_features=width, packing="2-bit two's complement, 4 per byte, feature j at bits 2*(j%4) of byte j//4")
    attrs = derived.derived_attrs(parent, **config)
    stored = packed_width(width) if pack_bits else width
    dtype = np.uint8 if pack_bits else np.int8
    fs = derived.existing_matches(store, out, attrs, (parent.n_rows, stored), dtype, parent.chunk_rows, overwrite)
    if fs is None:
        fs = derived.create(store, out, parent, stored, dtype, attrs)
    return fs, Discretize(lo, hi, bool(pack_bits))


def check_standardized(parent: FeatureSet, allow_raw: bool = False) -> None:
    """The thresholds (-0.25 / 0.15) are in units of a feature's standard deviation: they mean
    something only on z-scores. Refuse a set that ``standardize`` did not make, unless ``allow_raw``
    (features standardised elsewhere, or thresholds chosen for raw values on purpose)."""
    if allow_raw or parent.attrs.get("stage") == "standardize":
        return
    what = ("ternary FNE codes (made by discretize)" if parent.attrs.get("stage") == "discretize"
            else f"raw, unstandardised values (kind {parent.attrs.get('kind', '?')!r}, not made by standardize)")
    raise StoreError(f"feature set {parent.name!r} holds {what}; the thresholds are z-scores, so "
                     f"discretizing it thresholds the wrong quantity: standardize it first "
                     f"(`vsekit standardize --features {parent.name}`, then discretize {parent.name + '.z'!r}), "
                     f"or pass --allow-raw if its values are z-scores already")


def discretize(store: FeatureStore | str | os.PathLike, features: str, *,
               thresholds: Sequence[float] = DEFAULT_THRESHOLDS, pack: bool = False,
               name: str | None = None, cluster: "ClusterSpec | str | None" = None, overwrite: bool = False,
               allow_raw: bool = False) -> derived.Result:
    """Discretize feature set ``features`` into ``<features>.fne`` (or ``name``); see the module docstring."""
    from ..clusters import cluster_client

    store = passes.open_store(store)
    parent = store.features(features)
    pin = derived.Pin.of(parent, "discretize")
    check_thresholds(thresholds)
    check_standardized(parent, allow_raw)
    refuse_stale(parent)
    parent.check(complete=True)
    cluster = store.sets.check_cluster(cluster, "discretize")   # on object storage: clusters that reach it
    with store.writer(output_name(features, name), stage="vsekit discretize", multi=bool(cluster)):
        fs, fn = prepare(store, features, thresholds=thresholds, pack_bits=pack, name=name,
                         overwrite=overwrite, parent=parent, allow_raw=allow_raw)
        with cluster_client(cluster) as client:
            (fs,), (written,) = passes.write_chain(store, parent, [(fs, fn)], client, pin)
    return derived.Result(fs.name, parent.name, fs.n_rows, fs.counts()["failed"], written, len(fs.blocks()),
                          {"thresholds": f"{fn.lo} {fn.hi}", "packed": fn.packed})
