"""A readable description of a store: its tree, shapes, dtypes, chunking, provenance and progress."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import zarr

from ..words import plural
from . import integrity
from .interop import retry_advice
from .job_arrays import progress_lines
from .remake import remake_command
from .splits import refuse_stale
from .store import FAILED, SPLITS, FeatureStore

_HIDDEN_ATTRS = {"errors"}


def _dtype_name(arr: zarr.Array) -> str:
    dtype = arr.dtype
    return "str" if getattr(dtype, "kind", "") in ("T", "O", "U") else str(dtype)


def _array_line(name: str, arr: zarr.Array, indent: str) -> str:
    return f"{indent}{name:<10} {str(tuple(arr.shape)):<22} {_dtype_name(arr):<10} chunks={tuple(arr.chunks)}"


def _fmt_attr(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 100 else text[:97] + "..."


def describe(store: FeatureStore, name: str | None = None) -> str:
    lines: list[str] = []
    if name is None:
        a = store.attrs
        lines.append(f"{store.path}  (vsekit format {a.get('vsekit_format')}, dataset {a.get('dataset')!r})")
        lines.append(f"  image_root: {a.get('image_root') or '-'}")
        sources = a.get("source_files") or []
        if sources:
            lines.append(f"  source files: {', '.join(str(x) for x in sources[:3])}"
                         + (f" (+{len(sources) - 3} more)" if len(sources) > 3 else ""))
        if not a.get("complete", True):
            lines.append("  WARNING: this store was never completed (an ingest did not finish)")
        if store.n_images:
            codes = store.image_splits()
            per = ", ".join(f"{s} {int(np.sum(codes == i))}" for i, s in enumerate(SPLITS) if np.any(codes == i))
            lines.append(f"  images: {store.n_images} ({per})")
            for key in ("id", "path", "split"):
                lines.append(_array_line(key, store.root[f"images/{key}"], "    "))
        if store.n_captions:
            lines.append(f"  captions: {store.n_captions}")
            for key in ("text", "image"):
                lines.append(_array_line(key, store.root[f"captions/{key}"], "    "))
        if "tokens" in store.root:
            tok = store.root["tokens"]
            vocab = tok.attrs.get("vocabulary") or tok.attrs.get("itos") or []
            lines.append(f"  tokens: vocabulary {len(vocab)} words, min_count {tok.attrs.get('min_count')}")
            for key in sorted(tok.array_keys()):
                lines.append(_array_line(key, tok[key], "    "))
        tokens_swap, swapping = store.sets.swaps()
        if tokens_swap:
            lines.append(f"  tokens: being replaced (a tokenize stopped in its swap); `vsekit tokenize --store "
                         f"{store.path}` finishes it first")
        names = [n for n in store.feature_names() if n not in swapping]
        lines.append(f"  features: {len(names) + len(swapping) or 'none'}")
        for fname in names:
            lines.extend(_describe_set(store, fname, brief=True))
        for fname in swapping:
            lines.append(f"  {fname}: being replaced (an --overwrite is swapping the new set in, or one was killed "
                         f"while it did); any command that writes {fname!r} finishes it first")
    else:
        lines.extend(_describe_set(store, name, brief=False))
    return "\n".join(lines)


def _describe_set(store: FeatureStore, name: str, brief: bool) -> list[str]:
    fs = store.features(name)
    attrs = fs.attrs
    try:
        c = fs.counts()
        progress = f"done {c['done']} / failed {c['failed']} / pending {c['pending']}"
    except Exception as exc:  # a damaged status chunk
        c = None
        progress = (f"DAMAGED: status unreadable ({type(exc).__name__}); "
                    f"{integrity.repair_command(store.path, name)}")
    head = f"    {name}: {attrs.get('kind', '?')} {tuple(fs.shape)} {fs.data.dtype}  {progress}"
    if attrs.get("parent"):
        head += f"  (from {attrs['parent']})"
    lines = [head]
    if attrs.get("stale"):
        lines.append(f"      STALE: {attrs['stale']}; train, evaluate and export refuse it until it is made again "
                     f"(`vsekit info {store.path} {name}` shows how)")
    for key in sorted(fs.group.array_keys()):
        lines.append(_array_line(key, fs.group[key], "      "))
    if brief:
        if c is not None and c["failed"]:
            lines.extend(failed_lines(store, fs, limit=3))
        return lines
    lines.extend(progress_lines(fs))
    lines.append("      provenance:")
    for key in sorted(attrs):
        if key in _HIDDEN_ATTRS:
            continue
        lines.append(f"        {key}: {_fmt_attr(attrs[key])}")
    if attrs.get("stale"):
        try:
            refuse_stale(fs)
        except Exception as exc:  # noqa: BLE001 - its message is the remake advice
            lines.append(f"      {exc}")
    if c is not None and (c["failed"] or fs.errors()):
        lines.extend(failed_lines(store, fs, limit=20))
    return lines


def failed_lines(store: FeatureStore, fs, limit: int = 20) -> list[str]:
    """A set's failed rows: how many in each split, the first ``limit`` with their reasons, and the two
    ways out (retry them, or drop them: train and evaluate skip them, export with --drop-failed)."""
    status = fs.status_values()
    failed = np.flatnonzero(status == FAILED)
    errors = fs.errors()
    rows = sorted(set(int(r) for r in failed) | set(errors))
    same_rows = store.n_images == fs.n_rows
    where = ""
    if same_rows and len(failed):
        codes = store.image_splits()[failed]
        where = ", ".join(f"{s} {int(np.sum(codes == i))}" for i, s in enumerate(SPLITS) if np.any(codes == i))
    lines = [f"      failed rows ({len(rows)}):",
             f"        {plural(len(failed), 'failed row')}, by split: {where or '-'}"]
    ids = store.image_ids() if same_rows else None
    for row in rows[:limit]:
        label = f"{row} ({ids[row]})" if ids is not None else str(row)
        lines.append(f"        {label}: {errors.get(row, 'failed (no reason recorded)')}")
    if len(rows) > limit:
        lines.append(f"        ... and {len(rows) - limit} more (vsekit info {store.path} {fs.name})")
    lines.append("      two ways out:")
    retry = (retry_advice(store, fs.name) if limit > 3 else
             f"fix the files, then rerun the extraction with --retry-failed (`vsekit info {store.path} {fs.name}` "
             f"prints the exact command)")
    lines.append(f"        retry them: {retry}")
    lines.append(f"        drop them: train and evaluate already skip them (and say how many); "
                 f"`vsekit export vsepp|scan --store {store.path} --features {fs.name} --out DIR --drop-failed` "
                 f"leaves them and their captions out of an export")
    return lines


def verify_store(store: FeatureStore, name: str | None = None, *, repair: bool = False,
                 quick: bool = False) -> tuple[str, bool]:
    """Check the checksums of one feature set (or all); with ``repair`` mark damaged blocks pending.

    Returns the report text and whether every set is sound (after the repair, if asked: a repaired
    set is sound once its blocks are rewritten, which the text says how to do).
    """
    names = [name] if name else store.feature_names()
    lines, ok = [], True
    for n in names:
        fs = store.features(n)
        report = integrity.verify(fs, quick=quick)
        lines.append(report.summary(store.path))
        if report.ok:
            continue
        if not repair:
            ok = False
            continue
        # the set's one-writer guard: its lock file on disk, its lease on object storage
        with store.writer(n, stage="vsekit info --repair"):
            count = integrity.repair(fs, report)
        lines.append(f"repaired: {count} block(s) of {n} marked pending; now run: {remake_command(store, n)}")
    return "\n".join(lines) if lines else "no feature sets", ok
