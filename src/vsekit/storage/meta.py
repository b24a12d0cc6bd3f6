"""What a store records of itself and of its sets: the format version, the split codes, the settings
hash of a set and what differs between two sets' settings, JSON-safe attrs, a new store's root attrs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..version import __version__
from .base import FormatVersionError, StoreError

FORMAT_VERSION = 1
SPLITS: tuple[str, ...] = ("train", "val", "test", "restval")
SPLIT_CODES: dict[str, int] = {name: i for i, name in enumerate(SPLITS)}


def config_hash(config: Mapping[str, Any]) -> str:
    """A short, stable hash of a JSON-serialisable configuration."""
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: attrs that record when or by what a set was made, not its settings
_NOT_SETTINGS = frozenset({"code_version", "config_hash", "generation", "parent_generation", "created",
                           "finished", "complete", "stats_ready", "lock_token"})


def settings_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The settings ``new`` asks for that ``old`` has otherwise, as ``crops 10 → 5`` (``(none)``: unset)."""
    out = []
    for key in sorted(new):   # the settings asked for; the old set's attrs also hold what its writers added
        if key in _NOT_SETTINGS:
            continue
        a, b = _jsonable(old.get(key)), _jsonable(new.get(key))
        if a != b:
            out.append(f"{key} {_show(a)} → {_show(b)}")
    return out


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value: Any) -> Any:
    """Make attrs JSON-safe (numpy scalars and arrays, tuples, paths)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return value


def root_attrs(dataset: str, image_root: Any, source_files: Sequence[str]) -> dict[str, Any]:
    """The root attrs of a new store (``complete: false`` until its ingest finishes)."""
    return _jsonable({"vsekit_format": FORMAT_VERSION, "vsekit_version": __version__, "dataset": dataset,
                      "image_root": str(Path(image_root).resolve()) if image_root else "",
                      "source_files": list(source_files), "codes": SPLIT_CODES, "complete": False})


def refuse_dropping(path: Any, names: Sequence[str]) -> None:
    """Refuse to replace the store at ``path`` whose feature sets ``names`` would go with it
    (``--drop-features`` allows it)."""
    from ..words import plural

    if not names:
        return
    shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    raise StoreError(f"{path} holds {plural(len(names), 'feature set')} ({shown}); --overwrite would delete "
                     f"them. To change only the split, keep them: `vsekit split --store {path} --ratios ...` "
                     f"(or --split-file, or --val N --test N). To re-ingest and delete them, add --drop-features")


def check_format(where: Any, attrs: Mapping[str, Any]) -> None:
    """Refuse a Zarr group at ``where`` that is not a vsekit store, or one in a newer store format."""
    version = attrs.get("vsekit_format")
    if version is None:
        raise StoreError(f"{where} is a Zarr group but not a vsekit store (no vsekit_format attribute)")
    if int(version) > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where} was written in vsekit store format {version}, newer than this vsekit "
            f"({__version__}) reads (format {FORMAT_VERSION}); upgrade vsekit")
