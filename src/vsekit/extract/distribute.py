"""Extraction tasks on dask, and what to do when a task keeps killing its workers.

One task per row block (:func:`extract_block`): the worker computes and commits it (:mod:`.rows`),
skipping a block already committed, and only while its driver still holds the set's writer lock
(the token travels with the task; else :class:`.rows.DriverGone`). A block whose task keeps killing
its workers (``KilledWorker``) is cut in halves until the one row that does is found and marked
failed (:func:`bisect_block`); the driver then writes that block. Tasks no worker ran for dask's
no-workers-timeout end the run (:func:`no_workers`). docs/gpus_clusters.md, "Every block is committed
once" and "An image that kills its worker".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Callable

from ..clusters import ClusterSpec, cluster_client, report_worker_deaths
from ..storage.store import FAILED, Block, FeatureSet, FeatureStore, StoreError
from .job import Job, Site
from .plan import Plan
from .site import resolve
from .rows import LockGuard, commit, compute_block, decoding_summary
from .writer import BlockBuffer


def _done(job: Job, blk: Block, rows: int, **more: Any) -> dict[str, Any]:
    from .extractor import BUILDS

    return {"index": blk.index, "errors": {}, "pid": os.getpid(), "builds": BUILDS["count"], "rows": rows, **more}


def _open(job: Job) -> FeatureStore:
    """The store as a task opens it; its images on object storage read with the options its driver
    handed it."""
    if job.image_options:
        from ..storage.sources.remote import use_options

        use_options(job.image_options)
    return FeatureStore.open(job.store, mode="r+", storage_options=job.storage_options)


def extract_block(job: Job, block: tuple[int, int, int]) -> dict[str, Any]:
    """One dask task: compute and commit row block ``(index, start, stop)``; returns its failures.

    A block already committed is skipped (``"skipped": True``) without computing, and the block is
    committed only while the driver holding ``job.lock_token`` still holds the set (else
    :class:`.rows.DriverGone`). ``job.run.device`` is resolved here, on the worker (``auto`` on a GPU node
    is its GPU); the model is built once per worker process.
    """
    store = _open(job)
    store.lease_token = job.lock_token   # object storage: this task commits under its driver's lease
    fs = store.features(job.name)
    blk = Block(*block)
    guard = LockGuard(job, skip_committed=True, record_errors=False)
    if guard.refuses(fs, blk) is not None:
        return _done(job, blk, len(blk), skipped=True)
    resolved = resolve(job.run, job.site)   # here, on the worker
    buf = compute_block(job, blk, store=store, resolved=resolved)
    if commit(fs, buf, guard) is not None:   # another copy of this task committed it meanwhile
        return _done(job, blk, len(blk), skipped=True)
    return _done(job, blk, len(blk), errors=buf.errors, decoders=sorted(buf.decoders), device=resolved.run.device,
                 notes=list(resolved.notes))


def extract_rows(job: Job, block: tuple[int, int, int], lo: int, hi: int) -> dict[str, Any]:
    """A bisection task: rows ``[lo, hi)`` of ``block`` computed and returned, not written."""
    store = _open(job)
    blk = Block(*block)
    buf = compute_block(job, blk, store=store, span=(lo, hi))
    sl = slice(lo - blk.start, hi - blk.start)
    return _done(job, blk, hi - lo, errors=buf.errors, lo=lo, hi=hi, data=buf.data[sl],
                 status=buf.status[sl], extra={k: v[sl] for k, v in buf.extra.items()})


def run_on_dask(job: Job, fs: FeatureSet, blocks: list[Block], cluster: ClusterSpec) -> tuple[dict, dict, dict]:
    """One task per pending block on ``cluster`` (see module doc); each future is released as soon
    as its result is recorded, so a worker lost later has nothing of it to recompute."""
    from distributed.scheduler import KilledWorker, NoValidWorkerError, NoWorkerError
    from tqdm.auto import tqdm

    if not blocks:
        return {}, {}, {}
    device = job.run.device
    resources = {"GPU": 1} if cluster.uses_gpu(device) else None
    # the whole Execution, its device as each pinned worker sees it; each task resolves it on its
    # worker, with its share of the cores (extract/site.py)
    task_job = dataclasses.replace(job, run=job.run.replace(device=cluster.task_device(device)),
                                   site=Site("dask", cluster.task_cpus(device)))
    runs: dict[int, int] = {}
    builds: dict[int, int] = {}
    info: dict[str, Any] = {"decoding": {}, "devices": set(), "notes": set()}
    with cluster_client(cluster, resources=resources, device=device) as client:
        from distributed import as_completed

        started = time.time()
        token = f"{fs.attrs.get('config_hash')}-{time.time_ns()}"
        by_key, futures = {}, {}
        for b in blocks:
            fut = client.submit(extract_block, task_job, (b.index, b.start, b.stop),
                                key=f"vsekit-extract-{fs.name}-{b.index}-{token}",
                                retries=2, resources=resources, pure=False)
            by_key[fut.key] = b
            futures[fut.key] = fut

        def rows_of(b: Block) -> Callable[[int, int], Any]:
            def submit(lo: int, hi: int):
                return client.submit(extract_rows, task_job, (b.index, b.start, b.stop), lo, hi,
                                     resources=resources, pure=False,
                                     key=f"vsekit-extract-{fs.name}-{b.index}-{lo}-{hi}-{token}")
            return submit

        bar = tqdm(total=sum(len(b) for b in blocks), unit="img", desc=f"extract {fs.name}",
                   disable=not job.run.progress, smoothing=0.1)
        try:
            for fut in as_completed(list(futures.values())):
                try:
                    res = fut.result()
                except KilledWorker as exc:
                    b = by_key[fut.key]
                    report(f"block {b.index} (rows {b.start}-{b.stop - 1}) killed the dask workers that ran it "
                           f"({exc}); splitting it to find the image")
                    buf = bisect_block(client, rows_of(b), job.plan, b)
                    commit(fs, buf, LockGuard(job, skip_committed=False, record_errors=False))
                    res = {"index": b.index, "errors": buf.errors, "pid": os.getpid(), "builds": 0,
                           "rows": len(b)}
                fs.record_errors(res["errors"])
                # recorded: forget the future, so a worker lost later has nothing of it to recompute
                futures.pop(fut.key, None)
                fut.release()
                runs[res["index"]] = runs.get(res["index"], 0) + 1
                summary = decoding_summary(res.get("decoders", ()))
                if summary["decoders"] > info["decoding"].get("decoders", 0):   # the most parallel block
                    info["decoding"] = summary
                if res.get("device"):
                    info["devices"].add(res["device"])
                info["notes"].update(res.get("notes", ()))
                if res["builds"]:
                    builds[res["pid"]] = max(builds.get(res["pid"], 0), res["builds"])
                bar.update(res["rows"])
        except BaseException as exc:
            with contextlib.suppress(Exception):
                client.cancel(list(futures.values()))
            if isinstance(exc, (NoWorkerError, NoValidWorkerError)):
                raise no_workers(fs, cluster, exc) from None
            raise
        finally:
            bar.close()
        report_worker_deaths(client, started, report)
    return runs, builds, info


def no_workers(fs: FeatureSet, cluster: ClusterSpec, exc: Exception) -> StoreError:
    """The one error of a run whose tasks no worker ran for dask's no-workers-timeout (``exc``): what
    happened and what was kept (the committed blocks; the runner releases the lock)."""
    c = fs.counts()
    kept = ("the old set stays as it was" if fs.staged else
            f"kept {c['done']} done and {c['failed']} failed rows of {fs.n_rows} in {fs.name!r}, each block "
            "whole: rerun the same command to compute the rest")
    return StoreError(f"--cluster {cluster}: no dask worker could run the pending tasks for "
                      f"{getattr(exc, 'timeout', 0):g} s (its workers died and none came back; dask's "
                      f"distributed.scheduler.no-workers-timeout); {kept}")


def report(message: str) -> None:
    """A line on stderr for the user (the runner imports no Click)."""
    print(f"vsekit: {message}", file=sys.stderr, flush=True)


def bisect_block(client, submit: Callable[[int, int], Any], plan: Plan, block: Block) -> BlockBuffer:
    """Run ``block`` in ever smaller row ranges until every row is extracted or known to kill workers.

    ``submit(lo, hi)`` submits :func:`extract_rows` for rows ``[lo, hi)`` and returns its future. Returns the assembled block, failed rows marked with the reason.
    """
    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    buf = BlockBuffer.empty(plan, block)
    mid = (block.start + block.stop) // 2
    ranges = [(block.start, mid), (mid, block.stop)] if len(block) > 1 else [(block.start, block.stop)]
    futures = {submit(lo, hi): (lo, hi) for lo, hi in ranges if hi > lo}
    queue = as_completed(list(futures))
    for fut in queue:
        lo, hi = futures.pop(fut)
        try:
            res = fut.result()
        except KilledWorker as exc:
            if hi - lo == 1:
                why = (f"extracting this image killed every dask worker that tried it ({exc.__class__.__name__}); "
                       "marked failed")
                report(f"row {lo}: {why}")
                buf.status[lo - block.start] = FAILED
                buf.errors[lo] = why
                buf.filled += 1
                continue
            report(f"rows {lo}-{hi - 1} of block {block.index} killed a dask worker again; splitting them")
            m = (lo + hi) // 2
            for a, b in ((lo, m), (m, hi)):
                f = submit(a, b)
                futures[f] = (a, b)
                queue.add(f)
            continue
        sl = slice(res["lo"] - block.start, res["hi"] - block.start)
        buf.data[sl], buf.status[sl] = res["data"], res["status"]
        for key, value in res["extra"].items():
            buf.extra[key][sl] = value
        buf.errors.update(res["errors"])
        buf.filled += res["hi"] - res["lo"]
    return buf
