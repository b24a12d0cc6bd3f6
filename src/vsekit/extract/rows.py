"""The block engine, the same whatever runs it: :func:`compute_blocks` (read → decode → model →
features of a block's rows into a :class:`~.writer.BlockBuffer`, in the block's own batches, so its
bits do not depend on where it runs) and :func:`commit` (write it if the ``guard``, what entitles this
process to write, still allows it: checked here, once, right before the write). The executors import
this module, not each other. docs/architecture.md, "The path of a block", step 4.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..storage.faults import point
from ..storage.store import Block, FeatureSet, FeatureStore, StoreError
from .job import Job
from .plan import Plan
from .site import Resolved, resolve
from .reader import Item, RowDataset, decoded, stack, survive_worker_death
from .writer import BlockBuffer


@functools.lru_cache(maxsize=2)
def _boxes_json(path: str, mtime: float) -> dict:
    import json
    return json.loads(Path(path).read_text())


def block_dataset(store: FeatureStore, plan: Plan, blocks: Sequence[Block]) -> RowDataset:
    """The rows of ``blocks`` (in order) with their image files and, for regions, their boxes."""
    rows = np.concatenate([np.arange(b.start, b.stop) for b in blocks]) if blocks else np.zeros(0, int)
    from ..storage.sources import remote

    url = remote.image_url(store)   # images on object storage: URLs, fetched by the reader
    root = store.image_root
    paths_arr = store.root["images/path"]
    paths = []
    for b in blocks:
        paths += [remote.join(url, str(p)) if url else str(root / str(p)) for p in paths_arr[b.start:b.stop]]
    boxes: dict[int, Any] = {}
    if plan.kind == "regions" and plan.boxes != "detector":
        raw = _boxes_json(plan.boxes, os.path.getmtime(plan.boxes))
        ids_arr = store.root["images/id"]
        for b in blocks:
            ids = [str(i) for i in ids_arr[b.start:b.stop]]
            found = boxes_of_ids(raw, ids, plan.boxes)
            for r, i in zip(range(b.start, b.stop), ids):
                boxes[r] = found.get(i, f"no boxes for image id {i!r} (row {r}) in {plan.boxes}")
    check = store.attrs.get("image_root") and not store.attrs.get("allow_outside_root") and not url
    expected = {remote.join(url, k): v for k, v in (store.attrs.get("image_objects") or {}).items()} if url else None
    return RowDataset(plan, rows.tolist(), paths, boxes, root=root if check else None, expected=expected)


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
    ok = [it for it in items if it.error is None]
    failed, x = [(it, it.error) for it in items if it.error is not None], None
    if any(it.encoded is not None for it in ok):   # --decoder nvjpeg: the JPEGs decoded here, batched
        from .gpu_decode import batch_crops

        x, ok, more = batch_crops(items, ok, plan, extractor.device)
        failed += more
    for it, why in failed:
        if strict:
            raise StoreError(f"row {it.row}: {why} (--strict stops at the first bad image)")
        buf.put(it.row, None, why)
    if not ok:
        return
    if plan.detector == "butd-r101":  # original-size images, one at a time (butd.ButdExtractor)
        if getattr(items, "crops", None) is not None:   # images of one size were collated: each its own
            for it, crops in zip(ok, items.crops):
                it.crops = crops.numpy()
        extractor.put_items(ok, buf)
        return _check_intact(items)   # the buffer is dropped unwritten if not
    x = stack(items) if x is None else x   # the ok items' crops (collated where they were decoded)
    if plan.kind == "regions":
        boxes = extractor.detect(x) if plan.boxes == "detector" else [it.boxes for it in ok]
        feats = extractor.regions(x, boxes)
    else:
        feats, boxes = extractor.features(x), [None] * len(ok)
    _check_intact(items)
    for it, f, bx in zip(ok, feats, boxes):   # boxes back in original pixels
        buf.put(it.row, f, boxes=None if bx is None else bx / np.array([*it.scale, *it.scale], dtype=np.float32))


def _check_intact(items) -> None:
    """Refuse a batch whose shared buffer a decoding worker overwrote while its features were computed
    (:class:`.reader.BufferRing` rules it out; this makes a breach an error, never a wrong feature)."""
    intact = getattr(items, "intact", None)
    if intact is not None and not intact():
        rows = [it.row for it in items]
        raise StoreError(f"rows {min(rows)}-{max(rows)}: a decoding worker reused the batch's shared buffer "
                         "while its features were computed; nothing of the batch was written (a bug: please "
                         "report it; --workers 0 decodes without shared buffers)")


# --- computing ---------------------------------------------------------------------------------------
def extractor_for(job: Job, resolved: Resolved | None = None):
    """The model of ``job`` in this process, built once per process (on the device ``job.run``
    resolves to here)."""
    from .extractor import cached_extractor

    run = (resolved or resolve(job.run, job.site)).run
    return cached_extractor(job.plan, run.device, pin_memory=run.pin_memory, channels_last=run.channels_last)


def compute_blocks(job: Job, blocks: Sequence[Block], *, store: FeatureStore | None = None,
                   span: tuple[int, int] | None = None, extractor=None,
                   resolved: Resolved | None = None,
                   progress: Callable[[str, int], None] | None = None) -> Iterator[BlockBuffer]:
    """Each block of ``blocks`` computed (read, decode, model), in order; a block is yielded once its
    last batch is in. ``job.run`` is resolved on ``job.site`` here (:func:`.site.resolve`) unless the
    caller did (``resolved``). ``span=(lo, hi)`` (one block only): only rows ``[lo, hi)``, still cut
    where the whole block's batches are cut. ``progress(event, images)`` hears each batch:
    ``"decoded"`` before its model runs, ``"done"`` after (a progress bar moves per batch, not per
    block, and says what a single batch is doing)."""
    if not blocks:
        return
    resolved = resolved or resolve(job.run, job.site)
    run, progress = resolved.run, progress or (lambda event, images: None)
    store = store if store is not None else FeatureStore.open(job.store, mode="r+")
    extractor = extractor if extractor is not None else extractor_for(job, resolved)
    plan, size = job.plan, run.batch_size
    dataset = block_dataset(store, plan, blocks)
    batches: list[list[int]] = []
    owner: list[int] = []
    first = 0
    for k, b in enumerate(blocks):
        # the block cut into batches of the run's size, the same everywhere: its forward passes, hence its
        # bits, do not depend on where it runs
        cut = [list(range(s, min(s + size, first + len(b)))) for s in range(first, first + len(b), size)]
        if span is not None:
            lo, hi = span[0] - b.start + first, span[1] - b.start + first
            cut = [kept for kept in ([i for i in c if lo <= i < hi] for c in cut) if kept]
        batches += cut
        owner += [k] * len(cut)
        first += len(b)
    last = {k: i for i, k in enumerate(owner)}
    current: BlockBuffer | None = None
    items_of = decoded(dataset, batches, run.workers, getattr(extractor, 'pinned', False), run.prefetch,
                       threads=resolved.decoding == "threads")
    for i, (k, items) in enumerate(zip(owner, items_of)):
        point("extract:batch")
        if current is None:
            current = BlockBuffer.empty(plan, blocks[k])
        progress("decoded", len(items))
        survive_worker_death(run_items, extractor, plan, items, current, run.strict)
        progress("done", len(items))
        current.decoders.update(it.decoder for it in items)
        if last[k] == i:
            yield current
            current = None


def compute_block(job: Job, block: Block, **kwargs: Any) -> BlockBuffer:
    """One block (or rows ``span`` of it) computed: see :func:`compute_blocks`."""
    return next(compute_blocks(job, [block], **kwargs), None) or BlockBuffer.empty(job.plan, block)


# --- committing --------------------------------------------------------------------------------------
class DriverGone(RuntimeError):
    """The run that handed out a block no longer holds its set's writer lock: the block is not written."""


class LockGuard:
    """Entitled to write while the run holding the set's writer lock (``token``) still holds it.

    ``skip_committed``: a block already committed (status finished, chunk files of the recorded
    sizes) is not written again (a dask task run twice); ``record_errors``: the failure reasons go
    into the set's attrs with the block (only the driver writes attrs: in-process yes, dask no, its
    driver records them from the task's result).
    """

    def __init__(self, job: Job, *, skip_committed: bool, record_errors: bool):
        self.job, self.skip_committed, self.record_errors = job, skip_committed, record_errors

    def refuses(self, fs: FeatureSet, block: Block) -> str | None:
        from ..storage import integrity

        if self.skip_committed and integrity.block_committed(fs, block):
            return "already committed"
        # the driver's guard, read (only the driver renews it)
        held = fs.store.sets.holds(self.job.lock_name or self.job.name, self.job.lock_token)
        if not held and self.record_errors:   # this process is the run: it lost the set itself
            from ..storage.objstore import LeaseLost

            raise LeaseLost(f"lost the {fs.store.sets.guard} of feature set {self.job.name!r} in {fs.store.path}: another run "
                            f"took it over (this run was paused or cut off past its expiry); block "
                            f"{block.index} was not written")
        if not held:
            raise DriverGone(f"the run that submitted block {block.index} of {self.job.name!r} is gone; "
                             f"not writing it")
        return None

    def write(self, fs: FeatureSet, buf: BlockBuffer) -> bool:
        return buf.write(fs, record_errors=self.record_errors)


def commit(fs: FeatureSet, buf: BlockBuffer, guard) -> str | None:
    """Write ``buf`` (failure reasons, data and checksums, then the status that marks it done) if
    ``guard`` still entitles this process to; else the reason it did not (the block stays as it is).
    A guard raises when the whole run has lost the set (no later block may be written either)."""
    why = guard.refuses(fs, buf.block)
    if why is None and guard.write(fs, buf) is False:   # object storage: its record was there already
        why = "another writer committed it first (its commit record was there already)"
    return why


def decoding_summary(decoders: "set[str] | list[str]") -> dict[str, Any]:
    """How a block was decoded, from its rows' decoders (``pid:thread``): in how many processes and
    threads, so that a run can show (and record) that its decoding ran in parallel."""
    names = set(decoders)
    pids = {d.split(":", 1)[0] for d in names}
    return {"decoders": len(names), "processes": len(pids),
            "threads": len({d for d in names if "vsekit-decode" in d})}
