"""What each stage makes, and where its pipeline fingerprint is recorded: a store's or a set's attrs,
the tokens group's attrs, or a ``.vsekit-pipeline.json`` in an output folder (the table is in
docs/pipelines.md, "Up to date, reruns and resume"). A record is written only after the stage
finished, so it implies a complete output, and deleting an output deletes its record with it. A
command this module does not know and that has no ``--out`` makes no recorded output.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

MARKER = ".vsekit-pipeline.json"


def _store_root(path: str, mode: str = "r"):
    import zarr

    from ..storage.objstore import is_object_url

    if is_object_url(path):   # s3://...: the records live in the same attributes there
        from ..storage.objstore import Objects

        try:
            objects = Objects(path)
            if objects.get("zarr.json") is None:
                return None
            return zarr.open_group(objects.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3)
        except Exception:  # noqa: BLE001 - unreachable or broken counts as missing; its stage says why
            return None
    p = Path(path)
    if not (p / "zarr.json").exists():
        return None
    try:
        return zarr.open_group(str(p), mode=mode, zarr_format=3)
    except Exception:  # noqa: BLE001 - a broken store counts as missing
        return None


class _AttrsOutput:
    """An output whose record lives in a Zarr group's attrs (``_group``: the store, a set, the tokens).

    Every output (these and :class:`PathOutput`) says whether it ``exists`` and ``read``s and
    ``write``s the stage's record."""

    def read(self, key: str) -> dict[str, Any] | None:
        g = self._group()
        record = None if g is None else (dict(g.attrs.get("pipeline", {})).get(key))
        if record is not None and g.attrs.get("stale"):   # `vsekit split` changed the rows it was made from
            record = {**record, "fingerprint": "stale"}   # so the plan reruns it (with --overwrite)
        return record

    def write(self, key: str, record: dict[str, Any]) -> None:
        g = self._group("r+")
        if g is None:
            return
        current = dict(g.attrs.get("pipeline", {}))
        current[key] = record
        g.attrs["pipeline"] = current


@dataclass
class StoreOutput(_AttrsOutput):
    store: str

    def _group(self, mode: str = "r"):
        return _store_root(self.store, mode)

    def exists(self) -> bool:
        g = self._group()
        return g is not None and bool(g.attrs.get("complete", True))


@dataclass
class FeaturesOutput(_AttrsOutput):
    store: str
    name: str

    def _group(self, mode: str = "r"):
        root = _store_root(self.store, mode)
        if root is None:
            return None
        try:
            return root[f"features/{self.name}"]
        except KeyError:
            return None

    def exists(self) -> bool:
        g = self._group()
        if g is None or "status" not in set(g.array_keys()):
            return False
        import numpy as np

        return not bool(np.any(g["status"][:] == 0))  # no pending rows

    def incomplete(self) -> bool:
        return self._group() is not None and not self.exists()


@dataclass
class TokensOutput(_AttrsOutput):
    store: str

    def _group(self, mode: str = "r"):
        root = _store_root(self.store, mode)
        if root is None or "tokens" not in root:
            return None
        return root["tokens"]

    def exists(self) -> bool:
        g = self._group()
        return g is not None and "offsets" in set(g.array_keys())


@dataclass
class PathOutput:
    """A folder (record inside it) or a file (record in its folder, keyed by the file's name)."""

    path: str
    must_contain: str = ""   # a file that must exist inside the folder (e.g. metrics.json)

    def _target(self) -> Path:
        p = Path(self.path)
        return p / self.must_contain if self.must_contain else p

    def _marker(self) -> tuple[Path, str]:
        p = Path(self.path)
        if p.is_dir():
            return p / MARKER, self.must_contain
        return p.parent / MARKER, p.name

    def exists(self) -> bool:
        return self._target().exists()

    def _load(self) -> tuple[Path, dict]:
        marker, _ = self._marker()
        try:
            return marker, json.loads(marker.read_text())
        except (OSError, ValueError):
            return marker, {}

    def read(self, key: str) -> dict[str, Any] | None:
        _, sub = self._marker()
        _, data = self._load()
        return data.get(f"{sub}|{key}" if sub else key)

    def write(self, key: str, record: dict[str, Any]) -> None:
        marker, sub = self._marker()
        if not marker.parent.exists():
            return
        _, data = self._load()
        data[f"{sub}|{key}" if sub else key] = record
        tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(marker)


# per-command knowledge ---------------------------------------------------------------------------
@dataclass
class StageIO:
    """What a stage makes and which feature sets it reads (stores normalised to absolute paths)."""

    outputs: list[Any]                  # _AttrsOutput or PathOutput
    makes: list[tuple[str, str]]        # (store, feature set name)
    reads: list[tuple[str, str, str]]   # (store, feature set name, the option that names it)
    resumable: bool = True              # rerunning over a partial output continues it
    resume_file: str = ""               # resuming needs --resume when this file is in the output


def store_there(path: Any) -> bool:
    """Whether a store is at ``path`` (a local path or an object-store URL); an unreachable one is not."""
    from ..storage.store import store_exists

    try:
        return store_exists(str(path))
    except Exception:  # noqa: BLE001 - unreachable: the stage that opens it says why
        return False


def store_key(path: Any) -> str:
    """One spelling per store: a local path made absolute, an object-store URL without credentials."""
    from ..storage.objstore import is_object_url, public_url

    if is_object_url(str(path)):
        return public_url(str(path))
    return os.path.normpath(os.path.abspath(str(path)))


def made_sets(word: str, values: dict[str, Any], defaults: Callable[[str], Any]) -> list[str]:
    """The feature sets a feature stage writes, as the stage itself names them (one home per rule:
    ``extract.runner.default_name``, ``fne.standardize.output_name``, ``fne.discretize.output_name``,
    ``fne.combined.output_names``); the last one is the stage's output."""
    given = values.get("name") or values.get("out-name")
    feats = values.get("features")
    if word == "extract":
        from ..extract.runner import default_name

        return [given or default_name(values.get("model"), values.get("kind") or defaults("kind") or "global")]
    if word == "standardize":
        from ..fne.standardize import output_name

        return [output_name(feats, given)]
    if word == "discretize":
        from ..fne.discretize import output_name

        return [output_name(feats, given)]
    if word == "fne":
        from ..fne.combined import output_names

        z, q = output_names(feats)
        return [z, given or q]
    raise ValueError(f"{word!r} makes no feature set")


def _feature_inputs(values: dict[str, Any], store: str | None) -> list[tuple[str, str, str]]:
    if store is None or not values.get("features"):
        return []
    names = values["features"] if isinstance(values["features"], list) else [values["features"]]
    return [(store, str(n), "features") for n in names]


def stage_io(command: str, values: dict[str, Any], defaults: Callable[[str], Any]) -> StageIO:
    """Outputs, made and read feature sets of a stage, from its resolved values.

    ``defaults(key)`` gives the command's own default of an option (for names not given).
    """
    word = command.split()[0]
    store = store_key(values["store"]) if values.get("store") else None
    reads = _feature_inputs(values, store)
    feats = values.get("features")

    if word == "demo-data" and values.get("out-dir"):
        return StageIO([PathOutput(str(values["out-dir"]))], [], [], resumable=False)
    if word == "ingest" and store:
        fmt = command.split()[-1]
        name = str(values.get("name") or defaults("name") or "")
        if fmt in ("butd", "npz"):  # adds a feature set to the store (butd creates it when new)
            return StageIO([FeaturesOutput(store, name)], [(store, name)], [], resumable=False)
        makes = [(store, name)] if name and fmt == "precomp" else []
        return StageIO([StoreOutput(store)], makes, [], resumable=False)
    if word == "extract" and store:
        name = made_sets(word, values, defaults)[0]
        return StageIO([FeaturesOutput(store, name)], [(store, name)], [])
    if word in ("standardize", "discretize", "fne") and store and feats:
        made = made_sets(word, values, defaults)
        return StageIO([FeaturesOutput(store, made[-1])], [(store, m) for m in made], reads)
    if word == "tokenize" and store:
        return StageIO([TokensOutput(store)], [], [])
    if word == "evaluate":
        out = values.get("out")
        runs = values.get("runs") or values.get("run") or []
        runs = runs if isinstance(runs, list) else [runs]
        if out:
            return StageIO([PathOutput(str(out))], [], reads, resumable=False)
        if runs:  # vsekit evaluate writes next to the (first) run; an average of runs has its own file
            name = "metrics.json" if len(runs) == 1 else "metrics_ensemble.json"
            return StageIO([PathOutput(str(runs[0]), must_contain=name)], [], reads, resumable=False)
        return StageIO([], [], reads)
    if word == "train" and values.get("out"):
        return StageIO([PathOutput(str(values["out"]))], [], reads, resume_file="checkpoint_last.pt")
    if values.get("out"):
        return StageIO([PathOutput(str(values["out"]))], [], reads, resumable=False)
    return StageIO([], [], reads)
