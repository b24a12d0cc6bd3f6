"""The extraction runner: reader → extractor → background writer, one row block at a time,
in-process or as one dask task per row block.

A rerun skips the blocks already done (a block's status is written after its data); ``overwrite``
starts afresh. Bad images are marked failed with their reason and listed in the summary; with
``strict`` the first one stops the run before its block is written.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..storage import integrity
from ..storage.faults import point
from ..storage.lock import writer_lock
from ..storage.store import FAILED, PENDING, Block, FeatureSet, FeatureStore, StoreError
from .plan import Plan, make_plan
from .regions import region_arrays
from .reader import Item, RowDataset, block_batches, iter_batches, stack, survive_worker_death
from .writer import BlockBuffer, BlockWriter

DEVICES = ("cpu", "cuda")


@dataclass
class ExtractResult:
    """What a run did: rows done/failed/pending, blocks run and skipped, failures and speed."""

    name: str
    n_rows: int
    done: int
    failed: int
    pending: int
    blocks_run: int
    blocks_skipped: int
    seconds: float
    images: int
    errors: dict[int, str] = field(default_factory=dict)
    block_runs: dict[int, int] = field(default_factory=dict)   # block index → times reported done
    model_builds: dict[int, int] = field(default_factory=dict)  # pid → models built (cluster)

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def summary(self, max_errors: int = 20) -> str:
        lines = [f"{self.name}: {self.done} done, {self.failed} failed, {self.pending} pending of "
                 f"{self.n_rows} rows; ran {self.blocks_run} blocks, skipped {self.blocks_skipped} "
                 f"already done; {self.images} images in {self.seconds:.1f}s ({self.images_per_s:.1f} img/s)"]
        if self.errors:
            lines.append(f"failed images ({len(self.errors)}):")
            for row, why in sorted(self.errors.items())[:max_errors]:
                lines.append(f"  row {row}: {why}")
            if len(self.errors) > max_errors:
                lines.append(f"  ... and {len(self.errors) - max_errors} more (vsekit info STORE NAME)")
        return "\n".join(lines)


def default_name(model: str, kind: str) -> str:
    return f"{model}_{kind}"


class Interrupted(StoreError):
    """Ctrl-C: the finished blocks are kept; the message says how many and how to resume."""


#: Failure reasons whose cause may go away (the file appears, is replaced or becomes readable).
RETRYABLE = ("missing file", "empty (zero-byte) file", "cannot read", "cannot decode",
             "not an image file", "decoding ")


def retryable(reason: str) -> bool:
    return str(reason).startswith(RETRYABLE)


def resume_checks(fs: FeatureSet, retry_failed: bool) -> None:
    """Before resuming: re-extract damaged blocks (quick check) and, if asked, retry failed rows."""
    report = integrity.verify(fs, quick=True)
    if report.damaged:
        integrity.repair(fs, report)
        print(f"note: {len(report.damaged)} damaged block(s) of {fs.name} will be extracted again "
              f"({'; '.join(f'block {i}: {w}' for i, w in sorted(report.damaged.items())[:3])})",
              file=sys.stderr)
    if retry_failed:
        rows = retry_rows(fs)
        if rows:
            status = np.asarray(fs.status[:])
            status[rows] = PENDING
            for b in fs.blocks():   # whole status chunks, so the write never reads a chunk back
                if np.any(status[b.start:b.stop] == PENDING):
                    fs.status[b.start:b.stop] = status[b.start:b.stop]
            fs.clear_errors(rows)
            print(f"note: retrying {len(rows)} failed row(s) of {fs.name} (missing or unreadable files)",
                  file=sys.stderr)


def retry_rows(fs: FeatureSet) -> list[int]:
    """Failed rows whose recorded reason may have gone (a missing or unreadable file)."""
    status = np.asarray(fs.status[:])
    errors = fs.errors()
    return [int(r) for r in np.flatnonzero(status == FAILED) if retryable(errors.get(int(r), "cannot read"))]


def kept_message(fs: FeatureSet, store: FeatureStore) -> str:
    c = fs.counts()
    return (f"interrupted: kept {c['done']} done and {c['failed']} failed rows of {fs.n_rows} in "
            f"{fs.name!r} ({c['pending']} pending); rerun the same command to resume")


def extract(store: str | os.PathLike | FeatureStore, model: str = "vgg19", kind: str = "global", *,
            weights: str = "imagenet", name: str | None = None, crops: int = 1, keep_crops: bool = False,
            resize: int | None = None, resize_mode: str | None = None, input_size: int | None = None,
            interpolation: str | None = None, taps: str | None = None, grid: int = 7,
            boxes: str | None = None, max_regions: int = 36, min_regions: int | None = None, seed: int = 0,
            batch_size: int = 32, workers: int = 2, device: str = "auto", precision: str = "fp32",
            dtype: str | None = None, block_rows: int | None = None, cluster: str | None = None,
            strict: bool = False, overwrite: bool = False, progress: bool = True,
            retry_failed: bool = False, detector: str | None = None,
            detector_weights: str | None = None) -> ExtractResult:
    """Extract features of every image of ``store`` into ``features/<name>`` (see module doc).

    The run holds the set's writer lock. A resumed set is checked first: blocks whose chunk files
    are missing or truncated (or whose status chunk is unreadable) are extracted again, and with
    ``retry_failed`` the rows that failed on an unreadable or missing file are tried again. A set
    this run created is removed again if the run fails before any row is done.
    """
    from ..devices import resolve_device

    device = resolve_device(device)  # auto -> cuda|cpu; an unusable device is one Error: line
    if batch_size < 1 or workers < 0:
        raise ValueError("--batch-size must be >= 1 and --workers >= 0")
    if not device.startswith("cuda") and precision == "fp16":
        raise ValueError("--precision fp16 needs --device cuda (use fp32 or bf16 on CPU)")
    store = store if isinstance(store, FeatureStore) else FeatureStore.open(store, mode="r+")
    if store.n_images == 0:
        raise StoreError(f"{store.path} has no images; ingest a dataset first")
    plan = make_plan(model, kind, weights=weights, seed=seed, crops=crops, keep_crops=keep_crops,
                     resize=resize, resize_mode=resize_mode, input_size=input_size,
                     interpolation=interpolation, taps=taps, grid=grid, boxes=boxes,
                     max_regions=max_regions, min_regions=min_regions, precision=precision,
                     store_dtype=dtype, detector=detector, detector_weights=detector_weights)
    name = name or default_name(plan.model, kind)
    extra = region_arrays(plan) if kind == "regions" else None
    if block_rows is None:
        block_rows = max(batch_size, min(256, 8 * batch_size))
    with writer_lock(store.path, name, stage="vsekit extract"):
        existed = store.has_features(name) and not overwrite
        fs = store.create_features(name, plan.row_shape, plan.store_dtype, attrs=plan.attrs(),
                                   block_rows=block_rows, extra=extra, overwrite=overwrite)
        if existed:
            resume_checks(fs, retry_failed)
        fs.update_attrs(device=device)  # the resolved device of the latest run (not part of the config hash)
        blocks = fs.pending_blocks()
        skipped = len(fs.blocks()) - len(blocks)
        t0 = time.perf_counter()
        try:
            if cluster and cluster.startswith("slurm-array:"):   # no driver stays: see extract/array.py
                from .array import submit_for
                return submit_for(store, fs, plan, cluster, device, batch_size, strict, fresh=not existed)
            if cluster:
                runs, builds = _run_cluster(store, fs, plan, blocks, cluster, device, batch_size, strict, progress)
            else:
                runs, builds = _run_local(store, fs, plan, blocks, device, batch_size, workers, strict, progress)
        except BaseException as exc:
            if not existed and fs.counts()["pending"] == fs.n_rows:
                store.delete_features(name)   # nothing done: a retry with other options is not refused
                if isinstance(exc, KeyboardInterrupt):
                    raise Interrupted(f"interrupted before any row of {name!r} was done; nothing kept") from None
            elif isinstance(exc, KeyboardInterrupt):
                raise Interrupted(kept_message(fs, store)) from None
            raise
    seconds = time.perf_counter() - t0
    counts = fs.counts()
    errors = fs.errors()
    return ExtractResult(name=name, n_rows=fs.n_rows, done=counts["done"], failed=counts["failed"],
                         pending=counts["pending"], blocks_run=len(blocks), blocks_skipped=skipped,
                         seconds=seconds, images=sum(len(b) for b in blocks), errors=errors,
                         block_runs=runs, model_builds=builds)


# --- shared by both paths ------------------------------------------------------------------------
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
    return RowDataset(plan, rows.tolist(), paths, boxes)


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


# --- in-process ----------------------------------------------------------------------------------
def _run_local(store, fs, plan, blocks, device, batch_size, workers, strict, progress):
    from tqdm.auto import tqdm

    from .extractor import cached_extractor

    if not blocks:
        return {}, {}
    extractor = cached_extractor(plan, device)
    dataset = block_dataset(store, plan, blocks)
    batches, owner, first = [], [], 0
    for k, b in enumerate(blocks):
        for batch in block_batches(first, len(b), batch_size):
            batches.append(batch)
            owner.append(k)
        first += len(b)
    runs: dict[int, int] = {}
    bar = tqdm(total=len(dataset), unit="img", desc=f"extract {fs.name}", disable=not progress,
               smoothing=0.1)
    writer = BlockWriter(fs)
    current: BlockBuffer | None = None
    restore = _sigint_stops_decoders() if workers > 0 else (lambda: None)
    try:
        for k, items in zip(owner, iter_batches(dataset, batches, workers)):
            point("extract:batch")
            if current is None or current.block != blocks[k]:
                current = BlockBuffer.empty(plan, blocks[k])
            survive_worker_death(run_items, extractor, plan, items, current, strict)
            bar.update(len(items))
            if current.full:
                writer.submit(current)
                runs[current.block.index] = runs.get(current.block.index, 0) + 1
                current = None
    except KeyboardInterrupt:
        _stop_decoders()
        raise
    except RuntimeError as exc:   # torch noticed the workers _stop_decoders killed on Ctrl-C
        if _INTERRUPTED.is_set():
            raise KeyboardInterrupt from exc
        raise
    finally:
        restore()
        bar.close()
        writer.close()
    return runs, {os.getpid(): 1}


_INTERRUPTED = threading.Event()


def _sigint_stops_decoders():
    """While the loop runs, Ctrl-C first kills the decoding workers, then raises KeyboardInterrupt.

    Without this the KeyboardInterrupt lands inside the DataLoader, whose graceful shutdown waits
    for every worker (5 s each, longer when one is blocked on a full pipe): tens of seconds.
    Returns the function that puts the previous handler back.
    """
    _INTERRUPTED.clear()
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        _INTERRUPTED.set()
        try:
            _stop_decoders()
        except RuntimeError:   # torch's SIGCHLD handler reporting the workers just killed
            pass
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    return lambda: signal.signal(signal.SIGINT, previous)


def _stop_decoders() -> None:
    """Ctrl-C: end the decoding worker processes at once. Their graceful shutdown waits for each
    worker (torch joins with a 5 s timeout per worker, and a worker blocked on a full result pipe
    never answers), which made an interrupted extract take tens of seconds to exit."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    for child in multiprocessing.active_children():
        child.join(timeout=1)


# --- dask ----------------------------------------------------------------------------------------
def extract_block(store_path: str, name: str, plan_dict: dict, index: int, start: int, stop: int,
                  device: str, batch_size: int, strict: bool,
                  throughput: dict[str, str] | None = None) -> dict[str, Any]:
    """One dask task: extract and write row block ``[start, stop)``; returns its failures.

    The model is built once per worker process (cached in ``extractor._CACHE``). A task that dies
    with its worker is retried elsewhere; a half-written block is still pending, so the retry
    rewrites it whole (see :mod:`vsekit.extract.distribute`).
    """
    from .distribute import run_rows

    return run_rows(store_path, name, plan_dict, (index, start, stop), start, stop, device, batch_size,
                    strict, write=True, throughput=throughput)


def _run_cluster(store, fs, plan, blocks, spec, device, batch_size, strict, progress):
    """One task per pending block on the cluster of ``spec``; a block whose task keeps killing its
    workers is bisected to find the row that does (it is marked failed, the rest extracted)."""
    from tqdm.auto import tqdm

    from ..cluster import cluster_client, parse_cluster
    from ..devices import is_cuda, worker_device
    from .distribute import bisect_block, is_killed_worker, report, report_deaths, run_rows
    from .throughput import settings

    if not blocks:
        return {}, {}
    gpu = is_cuda(device)
    resources = {"GPU": 1} if gpu else None
    # local workers are pinned to one GPU each (CUDA_VISIBLE_DEVICES): there it is their cuda:0
    task_device = worker_device(device) if parse_cluster(spec)[0] == "local" else device
    runs: dict[int, int] = {}
    builds: dict[int, int] = {}
    path = str(store.path.resolve())
    tput = settings()
    with cluster_client(spec, resources=resources, device=device) as client:
        from distributed import as_completed

        started = time.time()
        token = f"{fs.attrs.get('config_hash')}-{time.time_ns()}"
        by_key = {}
        futures = []
        for b in blocks:
            fut = client.submit(extract_block, path, fs.name, plan.to_dict(), b.index, b.start, b.stop,
                                task_device, batch_size, strict, tput, key=f"vsekit-extract-{fs.name}-{b.index}-{token}",
                                retries=2, resources=resources, pure=False)
            by_key[fut.key] = b
            futures.append(fut)

        def submit_rows(b):
            def submit(lo, hi):
                return client.submit(run_rows, path, fs.name, plan.to_dict(), (b.index, b.start, b.stop), lo,
                                     hi, task_device, batch_size, strict, False, tput, resources=resources,
                                     key=f"vsekit-extract-{fs.name}-{b.index}-{lo}-{hi}-{token}", pure=False)
            return submit

        bar = tqdm(total=sum(len(b) for b in blocks), unit="img", desc=f"extract {fs.name}",
                   disable=not progress, smoothing=0.1)
        try:
            for fut in as_completed(futures):
                try:
                    res = fut.result()
                except Exception as exc:
                    if not is_killed_worker(exc):
                        raise
                    b = by_key[fut.key]
                    report(f"block {b.index} (rows {b.start}-{b.stop - 1}) killed the dask workers that ran it "
                           f"({exc}); splitting it to find the image")
                    buf = bisect_block(client, submit_rows(b), plan, b)
                    buf.write(fs, record_errors=False)
                    res = {"index": b.index, "errors": buf.errors, "pid": os.getpid(), "builds": 0,
                           "rows": len(b)}
                fs.record_errors(res["errors"])
                runs[res["index"]] = runs.get(res["index"], 0) + 1
                if res["builds"]:
                    builds[res["pid"]] = max(builds.get(res["pid"], 0), res["builds"])
                bar.update(res["rows"])
        except BaseException:
            client.cancel(futures)
            raise
        finally:
            bar.close()
        report_deaths(client, started)
    return runs, builds


__all__ = ["ExtractResult", "Interrupted", "extract", "extract_block", "default_name", "make_plan"]
