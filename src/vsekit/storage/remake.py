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
    """``vsekit extract ...`` with every option that enters the set's config hash: the fields of the
    extraction job that name an attr (:func:`vsekit.extract.job.remake_args`)."""
    from ..extract.job import remake_args

    a = attrs
    args = ["vsekit", "extract", "--store", str(store_path), "--model", str(a.get("model")),
            "--kind", str(a.get("kind")), "--weights", str(a.get("weights")), "--name", name]
    return shlex.join([*args, *remake_args(a), *extra])


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
