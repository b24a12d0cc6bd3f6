"""A readable description of a store: its tree, shapes, dtypes, chunking, provenance and progress."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import zarr

from . import integrity
from .store import SPLITS, FeatureStore

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
        names = store.feature_names()
        lines.append(f"  features: {len(names) or 'none'}")
        for fname in names:
            lines.extend(_describe_set(store, fname, brief=True))
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
    for key in sorted(fs.group.array_keys()):
        lines.append(_array_line(key, fs.group[key], "      "))
    if brief:
        return lines
    from .job_arrays import progress_lines   # a SLURM job array writing this set (extract --cluster slurm-array:N)

    lines.extend(progress_lines(fs))
    lines.append("      provenance:")
    for key in sorted(attrs):
        if key in _HIDDEN_ATTRS:
            continue
        lines.append(f"        {key}: {_fmt_attr(attrs[key])}")
    errors = fs.errors()
    if errors:
        lines.append(f"      failed rows ({len(errors)}):")
        ids = store.image_ids() if store.n_images == fs.n_rows else None
        for row, reason in sorted(errors.items())[:20]:
            label = f"{row} ({ids[row]})" if ids is not None else str(row)
            lines.append(f"        {label}: {reason}")
        from .interop import retry_advice

        lines.append(f"      {retry_advice(store, name)}")
    return lines


def verify_store(store: FeatureStore, name: str | None = None, *, repair: bool = False,
                 quick: bool = False) -> tuple[str, bool]:
    """Check the checksums of one feature set (or all); with ``repair`` mark damaged blocks pending.

    Returns the report text and whether every set is sound (after the repair, if asked: a repaired
    set is sound once its blocks are rewritten, which the text says how to do).
    """
    from .lock import writer_lock

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
        with writer_lock(store.path, n, stage="vsekit info --repair"):
            count = integrity.repair(fs, report)
        from .remake import remake_command

        lines.append(f"repaired: {count} block(s) of {n} marked pending; now run: {remake_command(store, n)}")
    return "\n".join(lines) if lines else "no feature sets", ok
