"""What every storage module shares, with no imports of its own from the package: the row status
codes, the store's errors and the image error its readers raise, row blocks and a set's generation.
``store``, ``integrity`` and ``lock`` all build on it, so none of them needs to import another in a
circle."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

PENDING, DONE, FAILED = 0, 1, 2
STATUS_NAMES = {PENDING: "pending", DONE: "done", FAILED: "failed"}
#: a writer lock (or a job array's set lease whose scheduler cannot answer) is stale this long after
#: its last refresh (its expiry)
STALE_ENV = "VSEKIT_LOCK_STALE_S"
DEFAULT_STALE_S = 3600.0


class StoreError(Exception):
    """A store cannot be used as asked; the message says why."""


class LeaseLost(StoreError):
    """This process no longer holds a write guard (it expired and another run took it)."""


class LeaseHeld(StoreError):
    """Another live run holds a set's lease; the message names it and when it expires."""


class FormatVersionError(StoreError):
    """The store was written by a newer vsekit format."""


class ProvenanceError(StoreError):
    """A feature set's provenance does not match what a command expects."""


class ImageError(Exception):
    """An image that cannot be used; the message says why. Raised by the readers of image files and
    of images inside containers (``storage.sources.shards``) and by decoding (``extract.images``)."""


@dataclass(frozen=True)
class Block:
    """A row block ``[start, stop)`` of a feature set, aligned to its chunks."""

    index: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


STORE_GUARD = ".store"   # the whole store's guard (`vsekit split`, `ingest --overwrite`); set names never start with "."
STAGED = "next-"   # ``.NAME.next-XXXX``: a set built beside NAME by --overwrite, swapped in on success
STAGING_NAME = re.compile(r"^\..+\.(partial|creating|old|next)-[0-9a-f]{8}$")   # the store's hidden sets


def owner_of(name: str) -> str:
    """The set a hidden staged set (``.NAME.next-*``, ``.NAME.partial-*``) is built for; else ``name``."""
    m = STAGING_NAME.match(name)
    return name[1:name.rindex(".")] if m and m.group(1) in ("next", "partial") else name


def read_generation(store_path: str | os.PathLike, name: str) -> str | None:
    """The ``generation`` of feature set ``name``, read from its metadata file now (never a cached copy).

    None for a set made before generations existed; ``"absent"`` when there is no such set (for
    instance between the two renames of a swap), so a reader never mistakes it for the one it began with.
    """
    try:
        meta = json.loads((Path(store_path) / "features" / name / "zarr.json").read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return "absent"
    return (meta.get("attributes") or {}).get("generation")


# One message per mistake: every command words a missing store, a missing feature set and a stage run
# before the one it needs with these, naming the command that fixes it (tests/test_one_message.py).

def not_a_store(where: object) -> str:
    """A store path with no store there (a typo, or no ingest yet)."""
    return f"{where} is not a vsekit store (no zarr.json there); create one with `vsekit ingest ...`"


def not_a_run(where: object) -> str:
    """A run folder with no run in it (a typo, or no training yet): evaluate, embed, report, resume."""
    return f"{where} is not a training run folder (no config.json); make one with `vsekit train ... --out {where}`"


def no_tokens(where: object) -> str:
    """A stage that reads captions' tokens, run before ``vsekit tokenize``."""
    return f"{where} has no tokens; run `vsekit tokenize --store {where}` first"


def no_feature_set(name: str, where: object, have: list[str]) -> str:
    """A feature set the store lacks: the sets it has (a typo gets its "did you mean" from
    ``suggest.improve_message``) and the stage that makes this one (``X.z`` standardize, ``X.fne``
    discretize, anything else extract)."""
    if name.endswith(".z"):
        fix = f"vsekit standardize --store {where} --features {name[:-2]}"
    elif name.endswith(".fne"):
        fix = f"vsekit discretize --store {where} --features {name[:-4]}"
    else:
        fix = f"vsekit extract --store {where} --name {name} ..."
    return f"no feature set {name!r} in {where}; it has: {', '.join(have) or 'none'} (made by `{fix}`)"
