"""The rows of row blocks through reader → extractor → writer buffer: what the in-process loop, each dask
task (:mod:`.distribute`) and each job-array task (:mod:`.array`) share. It imports none of them, so
the runner and its distributors depend on it and not on each other."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..storage.store import Block, FeatureStore, StoreError
from .plan import Plan
from .reader import Item, RowDataset, stack
from .writer import BlockBuffer


@functools.lru_cache(maxsize=2)
def _boxes_json(path: str, mtime: float) -> dict:
    import json
    return json.loads(Path(path).read_text())


def block_dataset(store: FeatureStore, plan: Plan, blocks: Sequence[Block]) -> RowDataset:
    """The rows of ``blocks`` (in order) with their image files and, for regions, their boxes."""
    rows = np.concatenate([np.arange(b.start, b.stop) for b in blocks]) if blocks else np.zeros(0, int)
    root = store.image_root
    paths_arr = store.root["images/path"]
    paths = []
    for b in blocks:
        paths += [str(root / str(p)) for p in paths_arr[b.start:b.stop]]
    boxes: dict[int, Any] = {}
    if plan.kind == "regions" and plan.boxes != "detector":
        raw = _boxes_json(plan.boxes, os.path.getmtime(plan.boxes))
        ids_arr = store.root["images/id"]
        for b in blocks:
            ids = [str(i) for i in ids_arr[b.start:b.stop]]
            found = boxes_of_ids(raw, ids, plan.boxes)
            for r, i in zip(range(b.start, b.stop), ids):
                boxes[r] = found.get(i, f"no boxes for image id {i!r} (row {r}) in {plan.boxes}")
    check = store.attrs.get("image_root") and not store.attrs.get("allow_outside_root")
    return RowDataset(plan, rows.tolist(), paths, boxes, root=root if check else None)


def boxes_of_ids(raw: dict, ids: list[str], path: str) -> dict[str, np.ndarray | str]:
    """The boxes of ``ids`` (K, 4), or the reason an image's boxes are unusable (it is marked failed).

    Refused: anything but a list of [x1, y1, x2, y2] numbers, NaN or infinite coordinates (RoIAlign
    would crash the process on them), and an empty list (an image without regions is failed rather
    than a done row with count 0, which the region models would divide by).
    """
    out: dict[str, np.ndarray | str] = {}
    for i in ids:
        if i not in raw:
            continue
        try:
            b = np.asarray(raw[i], dtype=np.float32).reshape(-1, 4)
        except (ValueError, TypeError):
            out[i] = f"boxes of image id {i!r} in {path} are not a list of [x1, y1, x2, y2]"
            continue
        if len(b) == 0:
            out[i] = f"boxes of image id {i!r} in {path}: the list is empty (no regions)"
        elif not np.all(np.isfinite(b)):
            k = int(np.flatnonzero(~np.isfinite(b).all(axis=1))[0])
            out[i] = f"boxes of image id {i!r} in {path}: box {k} {raw[i][k]} is not finite (NaN or inf)"
        else:
            out[i] = b
    return out


def run_items(extractor, plan: Plan, items: list[Item], buf: BlockBuffer, strict: bool) -> None:
    """Features of one batch of items into the block buffer (failed items get their reason)."""
    bad = [it for it in items if it.error is not None]
    if strict and bad:
        raise StoreError(f"row {bad[0].row}: {bad[0].error} (--strict stops at the first bad image)")
    ok = [it for it in items if it.error is None]
    for it in bad:
        buf.put(it.row, None, it.error)
    if not ok:
        return
    if plan.detector == "butd-r101":  # original-size images, one at a time (butd.ButdExtractor)
        return extractor.put_items(ok, buf)
    x = stack(ok)
    if plan.kind == "regions":
        boxes = extractor.detect(x) if plan.boxes == "detector" else [it.boxes for it in ok]
        feats = extractor.regions(x, boxes)
        for it, f, bx in zip(ok, feats, boxes):
            sx, sy = it.scale
            buf.put(it.row, f, boxes=bx / np.array([sx, sy, sx, sy], dtype=np.float32))
        return
    feats = extractor.features(x)
    for it, f in zip(ok, feats):
        buf.put(it.row, f)
