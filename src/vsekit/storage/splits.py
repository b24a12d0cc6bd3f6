"""Splits are metadata: re-split a store without touching its feature sets (``vsekit split``).

A new assignment changes ``images/split`` only (written beside the old one and swapped in under the
store's guard, kept in ``attrs["split_history"]``); what was computed from a split's rows (a
standardized set's statistics and the sets made from it, the vocabulary) is marked stale when those
rows change, and refused by every reader until remade (docs/store.md, "Splits are metadata").
"""

from __future__ import annotations

import datetime as _dt
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..words import plural
from .remake import remake_command
from .store import FAILED, SPLITS, FeatureSet, FeatureStore, StoreError, split_code

STALE = "stale"


@dataclass
class ResplitReport:
    store: str
    before: dict[str, int]
    after: dict[str, int]
    moved: int
    kept: list[str]
    stale: dict[str, str] = field(default_factory=dict)
    tokens_stale: str | None = None
    failed: dict[str, dict[str, int]] = field(default_factory=dict)   # set → split → failed rows in it
    dry_run: bool = False

    def summary(self) -> str:
        def counts(c: dict[str, int]) -> str:
            return ", ".join(f"{s} {n}" for s, n in c.items() if n) or "no images"

        verb = "would re-split" if self.dry_run else "re-split"
        lines = [f"{verb} {self.store}: {counts(self.after)} (was {counts(self.before)}); "
                 f"{plural(self.moved, 'image')} changed split"]
        if self.kept:
            lines.append(f"  feature sets kept as they are: {', '.join(self.kept)}")
        for name, why in self.stale.items():
            lines.append(f"  STALE {name}: {why}")
        if self.stale:
            lines.append("  remake them (train, evaluate and export refuse them until then): "
                         + " ; ".join(self._remake))
        if self.tokens_stale:
            lines.append(f"  note: {self.tokens_stale}")
        for name, per in self.failed.items():
            where = ", ".join(f"{s} {n}" for s, n in per.items() if n)
            if where:
                lines.append(f"  {name}: failed rows by split: {where} (train and evaluate skip them)")
        return "\n".join(lines)

    _remake: list[str] = field(default_factory=list)


def split_counts(codes: np.ndarray) -> dict[str, int]:
    return {s: int(np.sum(codes == i)) for i, s in enumerate(SPLITS)}


# --- the new assignment ----------------------------------------------------------------------------
def assign(store: FeatureStore, *, ratios: str | Sequence[float] | None = None, split_file: str | None = None,
           val: int | None = None, test: int | None = None, seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    """The new split code of every image and how it was chosen (exactly one way must be given)."""
    ways = [w for w, on in (("--ratios", ratios is not None), ("--split-file", split_file is not None),
                            ("--val/--test", val is not None or test is not None)) if on]
    if len(ways) != 1:
        raise ValueError("give one of --ratios TRAIN,VAL,TEST, --split-file FILE or --val N --test N"
                         + (f" (not {' and '.join(ways)})" if ways else ""))
    n = store.n_images
    if ratios is not None:
        from .sources.folder import assign_splits, parse_ratios

        r = parse_ratios(ratios)
        names = assign_splits(n, r, seed)   # the same assignment as `ingest folder --ratios R --seed S`
        return np.asarray([split_code(s) for s in names], np.uint8), {"ratios": list(r), "seed": int(seed)}
    if split_file is not None:
        from .sources.common import read_split_file

        table = read_split_file(split_file)
        ids = store.image_ids()
        missing = [str(i) for i in ids if str(i) not in table]
        if missing:
            raise ValueError(f"--split-file {split_file}: {len(missing)} of the store's {n} images have no split "
                             f"there (first: id {missing[0]!r}); every image needs one")
        return (np.asarray([split_code(table[str(i)]) for i in ids], np.uint8),
                {"split_file": str(Path(split_file).resolve())})
    # one of the two alone keeps the other split's images as they are and draws from the rest
    old = store.image_splits()
    keep = split_code("test") if test is None else split_code("val") if val is None else None
    pool = np.flatnonzero(old != keep) if keep is not None else np.arange(n)
    val, test = int(val or 0), int(test or 0)
    if val < 0 or test < 0 or val + test > len(pool):
        raise ValueError(f"--val {val} --test {test}: the store has {len(pool)} images to choose from"
                         f"{f' ({SPLITS[keep]} kept as it is)' if keep is not None else ''}; choose sizes "
                         f"that leave some for train")
    order = pool[np.random.default_rng(seed).permutation(len(pool))]
    codes = old.copy() if keep is not None else np.empty(n, np.uint8)
    codes[pool] = split_code("train")
    codes[order[:val]] = split_code("val")
    codes[order[val:val + test]] = split_code("test")
    how = {"val": val, "test": test, "seed": int(seed)}
    if keep is not None:
        how = {k: v for k, v in how.items() if k != SPLITS[keep]} | {"kept": SPLITS[keep]}
    return codes, how


# --- what a split change invalidates ---------------------------------------------------------------
def _rows_of(codes: np.ndarray, splits: str | Sequence[str]) -> np.ndarray:
    names = splits.split(",") if isinstance(splits, str) else list(splits)
    return np.isin(codes, [split_code(s.strip()) for s in names if str(s).strip()])


def split_dependent(store: FeatureStore, old: np.ndarray, new: np.ndarray) -> dict[str, str]:
    """The sets whose values came from rows of a split that now has other rows, with the reason;
    sets derived from them follow (a ``.z.fne`` of a stale ``.z``)."""
    roots: dict[str, str] = {}
    for name in store.feature_names():
        a = store.features(name).attrs
        if a.get("stage") == "standardize" and a.get("split") and not a.get("stats_from"):
            if not np.array_equal(_rows_of(old, a["split"]), _rows_of(new, a["split"])):
                roots[name] = (f"its mean/std came from split {a['split']!r} before `vsekit split` changed that "
                               f"split's images")
    out: dict[str, str] = {}
    for name in store.feature_names():
        for ancestor in store.features(name).lineage():
            if ancestor in roots:
                out[name] = roots[name] if ancestor == name else f"made from {ancestor!r}, which is stale"
                break
    return out


def stale_reason(fs: FeatureSet) -> str | None:
    return fs.attrs.get(STALE)


def refuse_stale(fs: FeatureSet) -> None:
    """Refuse a set that a re-split left stale, naming the commands that remake it and its stale ancestors."""
    why = stale_reason(fs)
    if not why:
        return
    chain = [n for n in reversed(fs.lineage()) if fs.store.has_features(n)
             and stale_reason(fs.store.features(n))]
    cmds = " ; ".join(remake_command(fs.store, n, "--overwrite") for n in chain)
    raise StoreError(f"feature set {fs.name!r} is stale: {why}; remake it: {cmds}")


# --- notes after ingest and extract ---------------------------------------------------------------
FEW = 10   # a val or test split this small gets a note at ingest (train warns below 100)


def split_notes(store: FeatureStore, name: str | None = None) -> list[str]:
    """What a researcher should hear right after ingest (a tiny val/test split) or extract (a split whose
    every image failed), with the command that changes the split and keeps the features."""
    codes = store.image_splits()
    fix = f"`vsekit split --store {store.path} --val N --test N` re-splits, keeping every feature set"
    if name is None:
        return [f"note: split {s!r} has {plural(int(np.sum(codes == i)), 'image')}: validation or test figures "
                f"on it are noise; {fix}" for i, s in enumerate(SPLITS)
                if s in ("val", "test") and 0 < np.sum(codes == i) < FEW]
    status = store.features(name).status_values()
    notes = []
    for i, s in enumerate(SPLITS):
        rows = codes == i
        bad = int(np.sum(rows & (status == FAILED)))
        if bad and bad == int(np.sum(rows)):
            notes.append(f"warning: every {s} image failed in {name!r} ({bad} of {bad}): training will refuse to "
                         f"validate on it; pass train --val-split, or {fix}, or retry the rows "
                         f"(`vsekit info {store.path} {name}`)")
    return notes


def resplit_since(store: FeatureStore, run_dir: str | os.PathLike) -> str | None:
    """A warning when ``store`` was re-split after the run in ``run_dir`` was trained (its config.json
    is older than the last re-split): the split it is evaluated on may hold images it trained on."""
    history = store.root.attrs.get("split_history") or []
    cfg = Path(run_dir) / "config.json"
    if not history or not cfg.is_file():
        return None
    at = _dt.datetime.fromisoformat(history[-1]["at"])
    trained = _dt.datetime.fromtimestamp(cfg.stat().st_mtime, _dt.timezone.utc)
    if trained > at + _dt.timedelta(seconds=1):
        return None
    return (f"{store.path} was re-split ({history[-1]['at']}) after {run_dir} was trained: the split evaluated "
            f"here may hold images it trained or validated on; retrain it on the new split")


# --- the command -----------------------------------------------------------------------------------
def resplit(store: FeatureStore | str | os.PathLike, *, ratios: str | Sequence[float] | None = None,
            split_file: str | None = None, val: int | None = None, test: int | None = None, seed: int = 0,
            dry_run: bool = False) -> ResplitReport:
    """Assign the store's images to splits anew, keeping every feature set (see the module docstring)."""
    store = store if isinstance(store, FeatureStore) else FeatureStore.open(store, mode="r+")
    old = store.image_splits()
    new, how = assign(store, ratios=ratios, split_file=split_file, val=val, test=test, seed=seed)
    stale = split_dependent(store, old, new)
    kept = [n for n in store.feature_names() if n not in stale]
    failed = {}
    for name in store.feature_names():
        status = store.features(name).status_values()
        if np.any(status == FAILED):
            failed[name] = {s: int(np.sum((status == FAILED) & (new == i))) for i, s in enumerate(SPLITS)}
    tokens_stale = None
    if store.has_tokens:
        vs = store.root["tokens"].attrs.get("vocab_splits")
        if vs and not np.array_equal(_rows_of(old, vs), _rows_of(new, vs)):
            tokens_stale = (f"the vocabulary was counted on the captions of {','.join(vs)} before this re-split; "
                            f"`vsekit tokenize --store {store.path}` counts it again")
    report = ResplitReport(str(store.path), split_counts(old), split_counts(new), int(np.sum(old != new)), kept,
                           stale, tokens_stale, failed, dry_run)
    report._remake = [remake_command(store, n, "--overwrite") for n in stale]
    if dry_run:
        return report
    # no writer runs meanwhile: the store lock on disk, the store's lease on object storage
    with store.store_writer("vsekit split"):
        store.sets.replace_array("images/split", new)
        record = {"at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **how,
                  "before": report.before, "after": report.after, "moved": report.moved,
                  "stale": sorted(stale)}
        history = list(store.root.attrs.get("split_history", [])) + [record]
        store.root.attrs.update({"split_history": history, "split_source": how,
                                 "split_generation": uuid.uuid4().hex})
        for name, why in stale.items():
            store.features(name).update_attrs(**{STALE: why})
        if tokens_stale:
            store.root["tokens"].attrs[STALE] = tokens_stale
    return report
