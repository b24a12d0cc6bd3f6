"""Extraction tasks on dask, and what to do when a task keeps killing its workers.

One task per row block (:func:`run_rows` with ``write=True``): the block's features are written by
the worker that made them, then its status. A task whose worker dies is run again elsewhere by the
scheduler; a half-written block is still pending, so the rerun writes it whole.

Exactly once: a task first asks the store whether its block is already committed (status finished
and chunk files of the recorded sizes, :func:`vsekit.storage.integrity.block_committed`) and, if so,
returns without computing; it asks again just before writing. A worker whose job was cancelled after
it committed blocks therefore never has them recomputed (the driver also releases each future once
its result is recorded, so the scheduler has nothing of it left to recompute). And a task writes
only while its driver still holds the set's writer lock (the lock's token is passed with the task):
once the driver is gone, in-flight tasks end without committing (:class:`DriverGone`).

A task that kills every worker it runs on (a codec that segfaults, an image that exhausts memory)
ends in ``KilledWorker`` after the scheduler's ``distributed.scheduler.allowed-failures``. Such a
block is cut in halves, each run as a task that returns its rows instead of writing them, halves
that still kill their worker are cut again, and a single row that kills its worker is marked failed
with that reason: the run goes on and every other row of the block is extracted. The driver then
writes the block (it owns it alone by then).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ..storage.store import FAILED, Block, FeatureStore
from .plan import Plan
from .reader import RowDataset, block_batches, iter_batches
from .writer import BlockBuffer

# test-only fault injection: a worker process exits at once when it decodes a file with this name
KILL_HOOK = "VSEKIT_TEST_KILL_ON"


class _KillingDataset:
    """Wraps a RowDataset: decoding a file named ``$VSEKIT_TEST_KILL_ON`` ends the process (tests)."""

    def __init__(self, dataset: RowDataset, name: str):
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        if os.path.basename(self.dataset.paths[i]) == self.name:
            os._exit(17)
        return self.dataset[i]


class DriverGone(RuntimeError):
    """The run that submitted a task no longer holds its set's writer lock: the task must not write."""


def driver_holds(store_path: str, name: str, token: str | None) -> bool:
    """Whether the writer lock of ``name`` is still held, live, by the run whose lock token is ``token``."""
    if token is None:
        return True
    from ..storage.lock import holder

    info = holder(store_path, name)
    return bool(info) and info.get("token") == token


def _skipped(blk: Block) -> dict[str, Any]:
    from .extractor import BUILDS

    return {"index": blk.index, "errors": {}, "pid": os.getpid(), "builds": BUILDS["count"],
            "rows": len(blk), "skipped": True}


def decoded_batches(dataset, batches: list[list[int]], threads: int):
    """The items of each batch, in order, decoded by ``threads`` threads (0/1: in this thread).

    Threads, not processes: a dask worker is a daemon process and may not start children. Decoding
    (PIL, numpy) releases the GIL, and at most two batches are decoded ahead.
    """
    if threads <= 1:
        yield from iter_batches(dataset, batches, 0)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="vsekit-decode") as pool:
        ahead: deque = deque()
        todo = iter(batches)
        for b in todo:
            ahead.append([pool.submit(dataset.__getitem__, i) for i in b])
            if len(ahead) > 2:
                yield [f.result() for f in ahead.popleft()]
        while ahead:
            yield [f.result() for f in ahead.popleft()]


def run_rows(store_path: str, name: str, plan_dict: dict, block: tuple[int, int, int], lo: int, hi: int,
             device: str, batch_size: int, strict: bool, write: bool,
             throughput: dict[str, str] | None = None, lock_token: str | None = None,
             decode_threads: int = 0) -> dict[str, Any]:
    """Extract rows ``[lo, hi)`` of ``block`` = (index, start, stop); write the block, or return its rows.

    The rows are cut into the block's own batches (those of ``block_batches``), so a row's batch
    neighbours, hence its bits, are the same as in a whole-block run wherever possible. With
    ``write``, a block already committed is skipped (``"skipped": True``) and the block is written
    only while the driver holding ``lock_token`` still holds the set (else :class:`DriverGone`).
    ``device`` is resolved here, on the worker (``auto`` on a GPU node is its GPU).
    """
    from ..devices import resolve_device
    from ..storage import integrity
    from . import throughput as tp
    from .extractor import BUILDS, cached_extractor
    from .rows import block_dataset, run_items

    store = FeatureStore.open(store_path, mode="r+")
    fs = store.features(name)
    blk = Block(*block)
    if write and integrity.block_committed(fs, blk):
        return _skipped(blk)
    if write and not driver_holds(store_path, name, lock_token):
        raise DriverGone(f"the run that submitted block {blk.index} of {name!r} is gone; not extracting it")
    tp.apply(throughput)  # the driver's --pin-memory / --channels-last
    plan = Plan.from_dict(plan_dict)
    extractor = cached_extractor(plan, resolve_device(device))
    dataset = block_dataset(store, plan, [blk])
    if os.environ.get(KILL_HOOK):
        dataset = _KillingDataset(dataset, os.environ[KILL_HOOK])
    buf = BlockBuffer.empty(plan, blk)
    first, last = lo - blk.start, hi - blk.start
    batches = [[i for i in b if first <= i < last] for b in block_batches(0, len(blk), batch_size)]
    for items in decoded_batches(dataset, [b for b in batches if b], decode_threads):
        run_items(extractor, plan, items, buf, strict)
    out = {"index": blk.index, "errors": buf.errors, "pid": os.getpid(), "builds": BUILDS["count"],
           "rows": hi - lo}
    if write:
        if integrity.block_committed(fs, blk):   # another copy of this task committed it meanwhile
            return _skipped(blk)
        if not driver_holds(store_path, name, lock_token):
            raise DriverGone(f"the run that submitted block {blk.index} of {name!r} is gone; not writing it")
        buf.write(fs, record_errors=False)
    else:
        sl = slice(first, last)
        out.update(lo=lo, hi=hi, data=buf.data[sl], status=buf.status[sl],
                   extra={k: v[sl] for k, v in buf.extra.items()})
    return out


def is_killed_worker(exc: BaseException) -> bool:
    from distributed.scheduler import KilledWorker

    return isinstance(exc, KilledWorker)


def report(message: str) -> None:
    """A line on stderr for the user (the runner imports no Click)."""
    print(f"vsekit: {message}", file=sys.stderr, flush=True)


def report_deaths(client, since: float) -> int:
    """Report each dask worker that died (left unexpectedly) since ``since``; returns how many."""
    try:
        events = client.get_events("all")
    except Exception:  # an old scheduler without the event log: nothing to say
        return 0
    dead = [e for t, e in events if t >= since and isinstance(e, dict)
            and e.get("action") == "remove-worker" and e.get("expected") is False]
    for e in dead:
        n = len(e.get("processing-tasks") or ())
        report(f"dask worker {e.get('worker', '?')} died during the run"
               + (f" with {n} task(s) in progress; they ran again elsewhere" if n else ""))
    return len(dead)


def bisect_block(client, submit: Callable[[int, int], Any], plan: Plan, block: Block) -> BlockBuffer:
    """Run ``block`` in ever smaller row ranges until every row is extracted or known to kill workers.

    ``submit(lo, hi)`` submits :func:`run_rows` (``write=False``) for rows ``[lo, hi)`` and returns
    its future. Returns the assembled block, failed rows marked with the reason.
    """
    from distributed import as_completed

    buf = BlockBuffer.empty(plan, block)
    mid = (block.start + block.stop) // 2
    ranges = [(block.start, mid), (mid, block.stop)] if len(block) > 1 else [(block.start, block.stop)]
    futures = {submit(lo, hi): (lo, hi) for lo, hi in ranges if hi > lo}
    queue = as_completed(list(futures))
    for fut in queue:
        lo, hi = futures.pop(fut)
        try:
            res = fut.result()
        except Exception as exc:
            if not is_killed_worker(exc):
                raise
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
