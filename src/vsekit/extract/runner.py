"""The extraction runner: reader → extractor → background writer, one row block at a time,
in-process or as one dask task per row block.

A rerun skips the blocks already done (a block's status is written after its data); ``overwrite``
starts afresh. Bad images are marked failed with their reason and listed in the summary; with
``strict`` the first one stops the run before its block is written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..devices import FLOAT32_RECORD
from ..storage import integrity
from ..storage.faults import point
from ..storage.lock import writer_lock
from ..storage.store import FAILED, PENDING, FeatureSet, FeatureStore, StoreError
from .plan import make_plan
from .regions import region_arrays
from .reader import block_batches, iter_batches, survive_worker_death
from .rows import block_dataset, run_items
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
    """Ctrl-C (exit 130) or SIGTERM (exit 143): the finished blocks are kept; the message says how
    many and how to resume. ``exit_code`` is what the CLI exits with: 128 + the signal's number."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self._exit_code = exit_code

    @property
    def exit_code(self) -> int:
        return self._exit_code if self._exit_code is not None else interrupted_exit_code()


class Terminated(KeyboardInterrupt):
    """SIGTERM (a preempted job, a login node's limit, ``kill``) during a run: handled like Ctrl-C,
    exit 143."""


def exit_code_of(exc: BaseException) -> int:
    return 143 if isinstance(exc, Terminated) else interrupted_exit_code()


@contextlib.contextmanager
def _sigterm_interrupts():
    """While a cluster run is driven from the main thread, SIGTERM raises :class:`Terminated`, so the
    run stops as on Ctrl-C (its jobs cancelled, its lock released, the kept rows reported). The CLI
    installs :func:`sigterm_interrupts` for the whole command; this covers library callers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _SIGNAL[0] = signum
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    from ..cluster import resolves_on_workers
    from ..devices import resolve_device

    if resolves_on_workers(cluster):   # slurm: the GPUs are on the nodes, not on this login node
        device = str(device or "auto").strip().lower()
    else:
        device = resolve_device(device)  # auto -> cuda|cpu; an unusable device is one Error: line
    if batch_size < 1 or workers < 0:
        raise ValueError("--batch-size must be >= 1 and --workers >= 0")
    if device != "auto" and not device.startswith("cuda") and precision == "fp16":
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
        # --overwrite of an existing set builds the new one beside it (fs.staged) and swaps on success;
        # a job array has no driver left to swap, so there the old set is replaced when the new one is made
        array = bool(cluster and cluster.startswith("slurm-array:"))
        fs = store.create_features(name, plan.row_shape, plan.store_dtype, attrs=plan.attrs(),
                                   block_rows=block_rows, extra=extra, overwrite=overwrite, beside=not array)
        if existed:
            resume_checks(fs, retry_failed)
        # the resolved device of the latest run and its float32 math (TF32 off; not part of the config hash)
        fs.update_attrs(device=device, **FLOAT32_RECORD)
        blocks = fs.pending_blocks()
        skipped = len(fs.blocks()) - len(blocks)
        t0 = time.perf_counter()
        try:
            if array:   # no driver stays: see extract/array.py
                from .array import submit_for
                return submit_for(store, fs, plan, cluster, device, batch_size, strict, fresh=not existed)
            if cluster:
                runs, builds = _run_cluster(store, fs, plan, blocks, cluster, device, batch_size, strict, progress)
            else:
                runs, builds = _run_local(store, fs, plan, blocks, device, batch_size, workers, strict, progress)
        except BaseException as exc:
            if fs.staged:   # a failed --overwrite: the old set stays as it was
                store.discard(fs)
                if isinstance(exc, KeyboardInterrupt):
                    raise Interrupted(f"interrupted before the new {name!r} was finished; the old one is "
                                      f"kept as it was") from None
            elif not existed and fs.counts()["pending"] == fs.n_rows:
                store.delete_features(name)   # nothing done: a retry with other options is not refused
                if isinstance(exc, KeyboardInterrupt):
                    raise Interrupted(f"interrupted before any row of {name!r} was done; nothing kept",
                                      exit_code_of(exc)) from None
            elif isinstance(exc, KeyboardInterrupt):
                raise Interrupted(kept_message(fs, store), exit_code_of(exc)) from None
            raise
        fs = store.commit(fs)
    seconds = time.perf_counter() - t0
    counts = fs.counts()
    errors = fs.errors()
    return ExtractResult(name=name, n_rows=fs.n_rows, done=counts["done"], failed=counts["failed"],
                         pending=counts["pending"], blocks_run=len(blocks), blocks_skipped=skipped,
                         seconds=seconds, images=sum(len(b) for b in blocks), errors=errors,
                         block_runs=runs, model_builds=builds)


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
    restore = _sigint_stops_decoders()
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
    """While the loop runs, Ctrl-C (or SIGTERM) first kills the decoding workers, then raises
    KeyboardInterrupt; the signal is remembered for the exit code (130 or 143).

    Without this the KeyboardInterrupt lands inside the DataLoader, whose graceful shutdown waits
    for every worker (5 s each, longer when one is blocked on a full pipe): tens of seconds.
    Returns the function that puts the previous handlers back.
    """
    _INTERRUPTED.clear()
    _SIGNAL[0] = signal.SIGINT
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        _INTERRUPTED.set()
        _SIGNAL[0] = signum
        try:
            _stop_decoders()
        except RuntimeError:   # torch's SIGCHLD handler reporting the workers just killed
            pass
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(sig, h) for sig, h in previous.items()]


_SIGNAL = [signal.SIGINT]   # the signal that interrupted the run (SIGINT unless SIGTERM came)


def sigterm_interrupts():
    """For a whole command: SIGTERM (``kill``, a scheduler's time limit) raises KeyboardInterrupt as
    Ctrl-C does, so locks are released and the kept rows reported; the exit code is 143, not 130.
    Returns the function that puts the previous handler back."""
    _SIGNAL[0] = signal.SIGINT
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        _SIGNAL[0] = signum
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def interrupted_exit_code() -> int:
    """128 + the number of the signal that interrupted the run (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + int(_SIGNAL[0])


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
                  throughput: dict[str, str] | None = None, lock_token: str | None = None,
                  decode_threads: int = 0) -> dict[str, Any]:
    """One dask task: extract and write row block ``[start, stop)``; returns its failures.

    The model is built once per worker process (cached in ``extractor._CACHE``). A task that dies
    with its worker is retried elsewhere; a half-written block is still pending, so the retry
    rewrites it whole (see :mod:`vsekit.extract.distribute`).
    """
    from .distribute import run_rows

    return run_rows(store_path, name, plan_dict, (index, start, stop), start, stop, device, batch_size,
                    strict, write=True, throughput=throughput, lock_token=lock_token,
                    decode_threads=decode_threads)


def _run_cluster(store, fs, plan, blocks, spec, device, batch_size, strict, progress):
    """One task per pending block on the cluster of ``spec``; a block whose task keeps killing its
    workers is bisected to find the row that does (it is marked failed, the rest extracted).

    Each future is released as soon as its result is recorded, and every task skips a block that is
    already committed and refuses to write once this run no longer holds the set's lock (see
    :mod:`vsekit.extract.distribute`): a lost worker's finished blocks are never computed again.
    """
    from tqdm.auto import tqdm

    from ..cluster import cluster_client, decode_threads, parse_cluster, task_device, uses_gpu
    from ..storage.lock import holder
    from .distribute import bisect_block, is_killed_worker, report, report_deaths, run_rows
    from .throughput import settings

    if not blocks:
        return {}, {}
    kind = parse_cluster(spec)[0]
    gpu = uses_gpu(kind, device)
    resources = {"GPU": 1} if gpu else None
    on_task = task_device(kind, device)   # slurm: resolved by each worker, not on this (login) node
    threads = decode_threads(kind)
    runs: dict[int, int] = {}
    builds: dict[int, int] = {}
    path = str(store.path.resolve())
    tput = settings()
    lock = holder(store.path, fs.name)
    lock_token = lock.get("token") if lock else None
    with _sigterm_interrupts(), cluster_client(spec, resources=resources, device=device) as client:
        from distributed import as_completed

        started = time.time()
        token = f"{fs.attrs.get('config_hash')}-{time.time_ns()}"
        by_key = {}
        futures = {}
        for b in blocks:
            fut = client.submit(extract_block, path, fs.name, plan.to_dict(), b.index, b.start, b.stop,
                                on_task, batch_size, strict, tput, lock_token, threads,
                                key=f"vsekit-extract-{fs.name}-{b.index}-{token}",
                                retries=2, resources=resources, pure=False)
            by_key[fut.key] = b
            futures[fut.key] = fut

        def submit_rows(b):
            def submit(lo, hi):
                return client.submit(run_rows, path, fs.name, plan.to_dict(), (b.index, b.start, b.stop), lo,
                                     hi, on_task, batch_size, strict, False, tput, None, threads,
                                     resources=resources, pure=False,
                                     key=f"vsekit-extract-{fs.name}-{b.index}-{lo}-{hi}-{token}")
            return submit

        bar = tqdm(total=sum(len(b) for b in blocks), unit="img", desc=f"extract {fs.name}",
                   disable=not progress, smoothing=0.1)
        try:
            queue = as_completed(list(futures.values()))
            for fut in queue:
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
                # recorded: forget the future, so a worker lost later has nothing of it to recompute
                futures.pop(fut.key, None)
                fut.release()
                runs[res["index"]] = runs.get(res["index"], 0) + 1
                if res["builds"]:
                    builds[res["pid"]] = max(builds.get(res["pid"], 0), res["builds"])
                bar.update(res["rows"])
        except BaseException:
            with contextlib.suppress(Exception):
                client.cancel(list(futures.values()))
            raise
        finally:
            bar.close()
        report_deaths(client, started)
    return runs, builds


__all__ = ["ExtractResult", "Interrupted", "extract", "extract_block", "default_name", "make_plan"]
