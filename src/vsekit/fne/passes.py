"""The two dask passes FNE post-processing makes over a feature set.

* ``scan``: one read of the source, reduced to per-feature statistics and non-finite counts. It runs
  over blocks of a canonical row count (:func:`stats.canonical_rows`) so the result is bit-identical
  whatever the store's chunking.
* ``write_pass``: one task per pending row block (aligned to the chunks of source and outputs),
  reading the block once and writing a chain of derived sets (``.z``, then ``.fne``), data before
  status, so a rerun resumes.

Both are dask graphs over the store, computed in-process (threads) or on ``--cluster`` through
:func:`vsekit.clusters.cluster_client`. Memory stays a few chunks per worker thread. On object storage
a cluster's tasks read and write their blocks through a :class:`~vsekit.storage.ref.StoreRef` (the
URL, its options in memory, the driver's lease token), and each block is committed by one
create-if-absent record (:mod:`vsekit.storage.objcommit`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..storage.ref import StoreRef
from ..storage.store import DONE, FAILED, Block, FeatureSet, FeatureStore, StoreError
from . import stats as st

#: How many non-finite positions a message lists.
SHOW = 8


def open_store(store: FeatureStore | str | os.PathLike, mode: str = "r+") -> FeatureStore:
    return store if isinstance(store, FeatureStore) else FeatureStore.open(store, mode=mode)


def row_codes(status: np.ndarray, use_rows: np.ndarray | None) -> np.ndarray:
    """Per-row code: CHECK for rows that are not failed; USE for ``use_rows`` that are done."""
    codes = np.where(status != FAILED, st.CHECK, 0).astype(np.uint8)
    if use_rows is not None:
        use = np.zeros(len(status), dtype=bool)
        use[use_rows] = True
        codes |= np.where(use & (status == DONE), st.USE, 0).astype(np.uint8)
    return codes


def _source_array(fs: FeatureSet, client: Any = None):
    """``fs``'s data as a dask array, one chunk per row block. With a cluster each block is read by its
    task, which opens the store as it carries it (:class:`StoreRef`: on object storage with its options)."""
    import dask.array as da

    if client is None:
        return da.from_zarr(fs.data, chunks=(fs.chunk_rows, *fs.shape[1:]))
    import dask

    read = dask.delayed(_read_rows, pure=False)
    ref = StoreRef.of(fs.store)
    return da.concatenate([da.from_delayed(read(ref, fs.name, b.start, b.stop), shape=(len(b), *fs.shape[1:]),
                                           dtype=fs.data.dtype) for b in fs.blocks()], axis=0)


def _read_rows(ref: StoreRef, name: str, start: int, stop: int) -> np.ndarray:
    return np.asarray(FeatureSet(ref.open(mode="r"), name).data[start:stop])


def _compute(client: Any, *graphs: Any) -> tuple:
    import dask

    if client is None:
        return dask.compute(*graphs, scheduler="threads")
    import sys
    import time

    from ..clusters import report_worker_deaths

    started = time.time()
    try:
        return dask.compute(*graphs, scheduler=client)
    finally:   # a task whose worker died ran again elsewhere; the user is told
        report_worker_deaths(client, started, lambda line: print(f"vsekit: {line}", file=sys.stderr, flush=True))


def _identity(a: np.ndarray, axis=None, keepdims=None) -> np.ndarray:
    return a


def scan(fs: FeatureSet, codes: np.ndarray, client: Any = None) -> np.ndarray:
    """The merged (4, D) state of ``fs``'s rows: statistics over USE rows, non-finite counts over CHECK rows."""
    import dask.array as da

    width = fs.shape[1]
    rows = st.canonical_rows(width)
    x = _source_array(fs, client).rechunk({0: rows})
    c = da.from_array(codes.reshape(-1, 1), chunks=(rows, 1))
    states = da.map_blocks(st.block_state, x, c, dtype=np.float64,
                           chunks=((st.STATE_ROWS,) * x.numblocks[0], x.chunks[1]))
    total = da.reduction(states, _identity, st.merge_stacked, combine=st.merge_stacked, axis=0,
                         keepdims=True, output_size=st.STATE_ROWS, dtype=np.float64, split_every=8,
                         concatenate=True)
    (state,) = _compute(client, total)
    return np.asarray(state)


def _bad_rows_block(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (~np.isfinite(x)).any(axis=1) & (c[:, 0] & st.CHECK).astype(bool)


def nonfinite_report(fs: FeatureSet, codes: np.ndarray, bad_columns: np.ndarray, total: int,
                     client: Any = None) -> str:
    """Find the rows holding non-finite values (a second pass, only when there are some) and describe them."""
    import dask.array as da

    x = _source_array(fs, client)
    c = da.from_array(codes.reshape(-1, 1), chunks=(fs.chunk_rows, 1))
    flags = da.map_blocks(_bad_rows_block, x, c, drop_axis=1, dtype=bool)
    (flags,) = _compute(client, flags)
    rows = np.flatnonzero(flags)
    examples = []
    for r in rows[:SHOW]:
        values = np.asarray(fs.data[int(r)])
        for col in np.flatnonzero(~np.isfinite(values))[: max(1, SHOW - len(examples))]:
            examples.append((int(r), int(col), float(values[col])))
        if len(examples) >= SHOW:
            break
    return describe_nonfinite(fs, total, rows, bad_columns, examples)


def _listing(values: Sequence[int], limit: int = 20) -> str:
    values = [int(v) for v in values]
    text = ", ".join(map(str, values[:limit]))
    return text + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")


def describe_nonfinite(fs: FeatureSet, total: int, rows: Sequence[int], columns: Sequence[int],
                       examples: Sequence[tuple[int, int, float]]) -> str:
    eg = "; ".join(f"row {r} column {c} = {v}" for r, c, v in examples[:SHOW])
    return (f"feature set {fs.name!r} in {fs.store.path} has {total} non-finite value(s) (NaN or inf) "
            f"in rows [{_listing(rows)}] and columns [{_listing(columns)}] (e.g. {eg}); refusing to "
            f"continue. Fix those rows (or mark them failed, status 2) and rerun.")


@dataclass(eq=False)
class Output:
    """One derived set written by ``write_pass``: ``fn`` maps the previous stage's stored block to this one's."""

    name: str
    fn: Callable[[np.ndarray], np.ndarray]
    pending: frozenset = field(default_factory=frozenset)
    target: str | None = None   # the name it takes when committed (a staged set's; None: ``name``)


def _write_block(x: np.ndarray, status: np.ndarray, block: Block, path: "FeatureStore | StoreRef",
                 stages: Sequence[Output], flags: Sequence[bool], check: bool, pin: Any = None) -> tuple[int, list]:
    """Run the chain of stages on one block and write the pending outputs; report non-finite values instead.

    ``pin`` (``derived.Pin``): the block ``x`` was read from the parent generation it names, or this raises.
    ``path``: the driver's own store (in-process threads), or how a task in another process opens it
    (a :class:`StoreRef`; on object storage its lease token each commit is checked against,
    storage/objcommit.py).
    """
    if pin is not None:
        pin.check()
    ok = status != FAILED
    if check and np.issubdtype(x.dtype, np.floating):
        bad = ~np.isfinite(x) & ok.reshape(-1, *([1] * (x.ndim - 1)))
        if bad.any():
            where = np.argwhere(bad)
            return int(bad.sum()), [(block.start + int(r), int(c), float(x[r, c])) for r, c in where[:1000]]
    store = path.open() if isinstance(path, StoreRef) else path   # a task in another process; or the driver's
    out_status = np.where(ok, DONE, FAILED).astype(np.uint8)
    values = x
    for stage, flag in zip(stages, flags):
        values = np.asarray(stage.fn(values))  # stages return new arrays, never views of their input
        if not ok.all():
            values[~ok] = 0
        if flag:   # on object storage: nothing if committed already, else chunks then one create-if-absent record
            FeatureSet(store, stage.name, stage.target).write_block(block, values, out_status)
    return 0, []


def write_pass(src: FeatureSet, outputs: Sequence[Output], client: Any = None, *,
               check: bool = True, pin: Any = None) -> int:
    """Write every pending block of ``outputs`` from ``src``; returns the number of blocks processed.

    With ``check`` (for sources no scan has vetted), raises ``StoreError`` naming rows and columns
    when the source holds non-finite values; blocks without them are written and stay done.
    """
    import dask

    blocks = src.blocks()
    todo = sorted(set().union(*(o.pending for o in outputs)))
    if not todo:
        return 0
    parts = _source_array(src, client).to_delayed().reshape(len(blocks), -1)[:, 0]
    status = np.asarray(src.status[:])
    stages = [Output(o.name, o.fn, target=o.target) for o in outputs]
    shared = dask.delayed(stages, pure=True, traverse=False)
    path = src.store if client is None else StoreRef.of(src.store)
    tasks = [dask.delayed(_write_block, pure=False)(
        parts[i], status[blocks[i].start:blocks[i].stop], blocks[i], path, shared,
        tuple(i in o.pending for o in outputs), check, pin) for i in todo]
    results = _compute(client, *tasks)
    if client is not None:   # a task (another process) killed between a block's record and its status, on
        # object storage: the record says done (in-process, that failure stops the run, and the next run's
        # pending_indices restores it)
        for o in outputs:
            src.store.sets.reconcile(FeatureSet(src.store, o.name, o.target))
    total = sum(r[0] for r in results)
    if total:
        positions = [p for r in results for p in r[1]]
        rows = sorted({p[0] for p in positions})
        cols = sorted({p[1] for p in positions})
        raise StoreError(describe_nonfinite(src, total, rows, cols, positions))
    return len(todo)


def write_chain(store: FeatureStore, parent: FeatureSet, chain: list, client: Any, pin: Any,
                check: bool = True) -> tuple[list[FeatureSet], list[int]]:
    """Write the pending blocks of ``chain`` (``(set, fn)`` pairs, each set derived from the one before
    it, the first from ``parent``) in one pass, carry the failed rows over, and commit the sets;
    returns them and each one's count of blocks written. A failure drops the sets (``derived.drop``)."""
    from .derived import copy_errors, drop, pending_indices

    try:
        outputs = [Output(fs.name, fn, pending_indices(fs), fs.target) for fs, fn in chain]
        write_pass(parent, outputs, client, check=check, pin=pin)
        for src, (fs, _) in zip([parent] + [fs for fs, _ in chain], chain):
            copy_errors(src, fs)
        pin.check()
    except BaseException as exc:
        for fs, _ in chain:
            drop(store, fs, exc)
        raise
    return [store.commit(fs) for fs, _ in chain], [len(o.pending) for o in outputs]
