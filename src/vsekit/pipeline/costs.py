"""The work each stage of a pipeline implies, for ``vsekit run --dry-run``: images x crops of an
extraction, epochs x steps of a training, images x captions scored by an evaluation. The counts
come from the store, else the Karpathy JSON (or its known sizes), else the caller (a smoke run).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence


Counts = dict[str, int]   # split → images, plus "captions" and "captions:<split>"


def _from_store(path: str) -> Counts | None:
    from ..storage.store import SPLITS, FeatureStore

    from .outputs import store_there

    if not store_there(path):
        return None
    try:
        st = FeatureStore.open(path)
        codes, owners = st.image_splits(), st.caption_images()
    except Exception:   # noqa: BLE001 - an unreadable store is its stage's own error
        return None
    out: Counts = {s: int((codes == i).sum()) for i, s in enumerate(SPLITS)}
    out["captions"] = len(owners)
    for i, s in enumerate(SPLITS):
        out[f"captions:{s}"] = int((codes[owners] == i).sum()) if len(owners) else 0
    return out


def _from_karpathy(path: str, restval_as_train: bool) -> Counts | None:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    out: Counts = {"train": 0, "val": 0, "test": 0, "restval": 0, "captions": 0}
    for rec in doc.get("images", []):
        s = rec.get("split", "train")
        s = "train" if s == "restval" and restval_as_train else s
        out[s] = out.get(s, 0) + 1
        n = len(rec.get("sentences", []))
        out["captions"] += n
        out[f"captions:{s}"] = out.get(f"captions:{s}", 0) + n
    return out


#: the Karpathy split files' sizes (images per split; 5 captions per image, COCO's few extras left
#: out), assumed when the file is not there yet so that a recipe's cost is known before its data is
KARPATHY_SIZES = {
    "dataset_coco.json": {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000},
    "dataset_flickr30k.json": {"train": 29_000, "val": 1_014, "test": 1_000},
    "dataset_flickr8k.json": {"train": 6_000, "val": 1_000, "test": 1_000},
}


def _assumed(path: str, restval_as_train: bool) -> Counts | None:
    sizes = KARPATHY_SIZES.get(Path(path).name)
    if sizes is None:
        return None
    sizes = dict(sizes)
    if restval_as_train and "restval" in sizes:
        sizes["train"] += sizes.pop("restval")
    out = _from_demo(sizes)
    out["assumed"] = 1
    return out


def _from_demo(counts: dict[str, int], per_image: int = 5) -> Counts:
    out: Counts = dict(counts)
    out["captions"] = sum(counts.values()) * per_image
    for s, n in counts.items():
        out[f"captions:{s}"] = n * per_image
    return out


def _n(x: int) -> str:
    return f"{x:,}"


def _pl(n: int, word: str) -> str:
    return f"{n:,} {word if n == 1 else word + 's'}"


def stage_work(stage, counts: Counts | None) -> str:
    cmd = stage.spec.command
    v = {k.replace("-", "_"): x for k, x in stage.values.items()}   # canonical keys are --option names
    if counts is None:
        return "its store's size is not known until its input is there"
    n = sum(counts.get(s, 0) for s in ("train", "val", "test", "restval"))
    if cmd.startswith("ingest"):
        return f"{_pl(n, 'image')}, {_pl(counts.get('captions', 0), 'caption')}"
    if cmd == "extract":
        crops = int(v.get("crops") or 1)
        size = v.get("input_size") or "the weights' input size"
        size = f"{size} px" if isinstance(size, int) else size
        return (f"{_n(n)} images x {crops} crop{'s' if crops != 1 else ''} = {_n(n * crops)} forward passes of "
                f"{v.get('model')} ({v.get('kind') or 'global'}, {size})")
    if cmd in ("standardize", "fne"):
        return f"{_n(n)} rows read twice (statistics of {v.get('split') or 'train'}, then the z-scores)"
    if cmd == "discretize":
        return f"{_n(n)} rows read once"
    if cmd == "tokenize":
        return f"{_pl(counts.get('captions', 0), 'caption')}"
    if cmd == "train":
        return _train_work(v, counts)
    if cmd == "evaluate":
        split = v.get("split") or "test"
        runs = len(v.get("runs") or ()) or 1
        return (f"{_n(counts.get(split, 0))} {split} images x {_n(counts.get(f'captions:{split}', 0))} captions "
                f"scored{f' by each of {runs} runs' if runs > 1 else ''}")
    return ""


def _train_work(v: dict[str, Any], counts: Counts) -> str:
    from ..train.config import resolve_config

    try:
        cfg = resolve_config(v.get("model"), list(v.get("preset") or ()),
                             **{k: v.get(k) for k in ("epochs", "batch_size", "captions") if v.get(k) is not None})
    except (ValueError, KeyError) as exc:
        return f"(not estimated: {exc})"
    split = cfg.train_split
    pairs = counts.get(split, 0) if cfg.captions == "one" else counts.get(f"captions:{split}", 0)
    steps = math.ceil(pairs / max(1, cfg.batch_size)) if pairs else 0
    return (f"{_pl(cfg.epochs, 'epoch')} x {_pl(steps, 'step')} ({_n(pairs)} {split} pairs per epoch, batch "
            f"{cfg.batch_size}) = {_pl(cfg.epochs * steps, 'step')} of {cfg.model}")


def work_lines(steps: Sequence[Any], demo_counts: dict[str, int] | None = None) -> list[str]:
    """One line per stage: the work it implies (whether it runs or is skipped)."""
    known: dict[str, Counts] = {}
    lines = ["work each stage implies:"]
    for k, step in enumerate(steps, start=1):
        st = step.stage
        if st.spec.command == "demo-data" and st.values.get("images"):   # the ingest after it reads these
            from ..storage.demo import demo_splits

            given = [st.values.get(k) for k in ("val", "test")]
            demo_counts = demo_splits(int(st.values["images"]), *(None if v is None else int(v) for v in given))
        store = st.values.get("store")
        store = str(store) if store else None
        counts = known.get(store) if store else None
        if counts is None and store:
            counts = _from_store(store)
        if counts is None and st.spec.command == "ingest karpathy" and st.values.get("json-path"):
            path, restval = str(st.values["json-path"]), bool(st.values.get("restval-as-train"))
            counts = _from_karpathy(path, restval) or _assumed(path, restval)
            if counts and counts.get("assumed"):
                lines.append(f"  (sizes of {Path(path).name} assumed: {path} is not there yet)")
        if counts is None and demo_counts:
            counts = _from_demo(demo_counts)
        if store and counts is not None:
            known[store] = counts
        if st.spec.command == "evaluate" and counts is None:
            counts = next(iter(known.values()), None)
        what = stage_work(st, counts)
        if what:
            lines.append(f"  [{k}/{len(steps)}] {st.id}: {what}")
    return lines
