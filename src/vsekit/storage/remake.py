"""The exact command that (re)makes a feature set, rebuilt from its provenance attrs.

Messages that tell the user to resume, repair or retry a set quote it, so the advice can be pasted.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, Mapping

_DERIVED = {"standardize": "standardize", "discretize": "discretize"}


def extract_command(store_path: str | os.PathLike, name: str, attrs: Mapping[str, Any],
                    *extra: str) -> str:
    """``vsekit extract ...`` with every option that enters the set's config hash."""
    a = attrs
    args = ["vsekit", "extract", "--store", str(store_path), "--model", str(a.get("model")),
            "--kind", str(a.get("kind")), "--weights", str(a.get("weights")), "--name", name]
    if a.get("weights") == "none":
        args += ["--seed", str(a.get("seed", 0))]
    if a.get("kind") in ("global", "fne"):
        args += ["--crops", str(a.get("crops", 1))]
        if a.get("keep_crops"):
            args.append("--keep-crops")
    own = a.get("detector") == "butd-r101"   # BUTD has its own preprocessing: those options are refused
    for opt, key in (("--resize", "resize"), ("--resize-mode", "resize_mode"),
                     ("--input-size", "crop_size"), ("--interpolation", "interpolation"),
                     ("--precision", "precision"), ("--dtype", "dtype")):
        if a.get(key) is not None and not (own and key in ("resize", "resize_mode", "crop_size", "interpolation")):
            args += [opt, str(a[key])]
    if a.get("kind") == "fne" and a.get("taps"):
        args += ["--taps", ",".join(t["name"] for t in a["taps"])]
    if a.get("kind") == "grid":
        args += ["--grid", str(a.get("grid"))]
    if a.get("kind") == "regions":
        args += ["--boxes", str(a.get("boxes")), "--max-regions", str(a.get("max_regions")),
                 "--min-regions", str(a.get("min_regions"))]
        if a.get("detector"):
            args += ["--detector", str(a["detector"]), "--detector-weights", str(a.get("detector_weights"))]
    if a.get("block_rows"):
        args += ["--block-rows", str(a["block_rows"])]
    return shlex.join([*args, *extra])


def remake_command(store, name: str, *extra: str) -> str:
    """The command that makes feature set ``name`` of ``store`` (extract, standardize, discretize)."""
    fs = store.features(name)
    a = fs.attrs
    stage = a.get("stage")
    if stage in _DERIVED and a.get("parent"):
        args = ["vsekit", _DERIVED[stage], "--store", str(store.path), "--features", a["parent"]]
        if stage == "standardize":
            if a.get("stats_from"):
                args += ["--stats-from", a["stats_from"]]
            elif a.get("split"):
                args += ["--split", a["split"]]
        else:
            args += ["--thresholds", *(str(t) for t in a.get("thresholds", []))]
            if a.get("packed"):
                args.append("--pack")
        args += ["--name", name]
        return shlex.join([*args, *extra])
    if "crop_size" in a and not a.get("parent"):   # made by `vsekit extract`
        return extract_command(store.path, name, a, *extra)
    return f"the command that made {name!r} (see `vsekit info {store.path} {name}`)"


def root_set(store, name: str) -> str:
    """The first ancestor of ``name`` that no stage derived (the extraction its failures come from)."""
    seen = name
    while True:
        parent = store.features(seen).attrs.get("parent")
        if not parent or not store.has_features(parent):
            return seen
        seen = parent
