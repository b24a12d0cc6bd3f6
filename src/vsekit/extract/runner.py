"""The extraction runner: lock the set, create or resume it (a rerun skips the blocks already done),
run an executor over its pending row blocks (in-process here, :func:`run_in_process`; dask,
:mod:`.distribute`; a job array, :mod:`.array`), then commit the set or discard what a failed run
started. Computing and committing a block is the block engine's (:mod:`.rows`). docs/architecture.md,
"The path of a block".
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..clusters import ClusterSpec, parse_cluster
from ..words import plural
from ..devices import FLOAT32_RECORD
from ..interrupts import Interrupted, handling, interrupted
from ..storage import integrity
from ..storage.store import FAILED, PENDING, FeatureSet, FeatureStore, StoreError
from ..storage.sources import remote
from .images import UNRECORDED_DECODER, decoder_attrs
from .job import Execution, ExtractOptions, Job, split_options
from .plan import make_plan
from .regions import region_arrays
from .rows import LockGuard, commit, compute_blocks, decoding_summary, extractor_for
from .site import resolve
from .writer import BlockWriter


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
    decoding: dict[str, int] = field(default_factory=dict)  # the most parallel block: decoders, processes, threads
    devices: list[str] = field(default_factory=list)        # where the blocks ran (resolved on the workers)
    image_reads: dict[str, int] = field(default_factory=dict)  # images on object storage read by this process

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def summary(self, max_errors: int = 20) -> str:
        lines = [f"{self.name}: {self.done} done, {self.failed} failed, {self.pending} pending of "
                 f"{plural(self.n_rows, 'row')}; ran {plural(self.blocks_run, 'block')}, skipped "
                 f"{self.blocks_skipped} already done; {self.images} images in {self.seconds:.1f}s ({self.images_per_s:.1f} img/s)"]
        if self.errors:
            lines.append(f"failed images ({len(self.errors)}):")
            for row, why in sorted(self.errors.items())[:max_errors]:
                lines.append(f"  row {row}: {why}")
            if len(self.errors) > max_errors:
                lines.append(f"  ... and {len(self.errors) - max_errors} more (vsekit info STORE NAME)")
        if self.image_reads.get("requests"):
            r = self.image_reads
            lines.append(f"images on object storage: {plural(r['requests'], 'GET')}, {r.get('bytes', 0):,} bytes, "
                         f"{plural(r.get('retries', 0), 'transient failure')} retried")
        return "\n".join(lines)


def default_name(model: str, kind: str) -> str:
    return f"{model}_{kind}"


#: Failure reasons whose cause may go away (the file appears, is replaced or becomes readable).
RETRYABLE = ("missing file", "empty (zero-byte) file", "cannot read", "cannot decode",
             "not an image file", "decoding ")


def resume_checks(fs: FeatureSet, retry_failed: bool) -> None:
    """Before resuming: re-extract damaged blocks (quick check) and, if asked, retry failed rows."""
    report = integrity.verify(fs, quick=True)
    if report.damaged:
        integrity.repair(fs, report)
        print(f"note: {len(report.damaged)} damaged block(s) of {fs.name} will be extracted again "
              f"({'; '.join(f'block {i}: {w}' for i, w in sorted(report.damaged.items())[:3])})",
              file=sys.stderr)
    if retry_failed:   # the failed rows whose recorded reason may have gone (a missing or unreadable file)
        status, errors = np.asarray(fs.status[:]), fs.errors()
        rows = [int(r) for r in np.flatnonzero(status == FAILED)
                if str(errors.get(int(r), "cannot read")).startswith(RETRYABLE)]
        if rows:
            status[rows] = PENDING
            reopened = [b for b in fs.blocks() if np.any(status[b.start:b.stop] == PENDING)]
            fs.store.sets.reopen(fs, [b.index for b in reopened])
            for b in reopened:   # whole status chunks, so the write never reads a chunk back
                fs.status[b.start:b.stop] = status[b.start:b.stop]
            fs.clear_errors(rows)
            print(f"note: retrying {len(rows)} failed row(s) of {fs.name} (missing or unreadable files)",
                  file=sys.stderr)


def extract(store: str | os.PathLike | FeatureStore, model: str = "vgg19", kind: str = "global",
            cluster: "ClusterSpec | str | None" = None, **options: Any):
    """Extract features of every image of ``store`` into ``features/<name>``: the library form of
    ``vsekit extract``, taking every option it has (the fields of :class:`~.job.ExtractOptions` and
    :class:`~.job.Execution`, e.g. ``crops=10, batch_size=64, device="cuda", pin_memory="on",
    channels_last=False, cluster="local:2"``). Returns an :class:`ExtractResult`, or for
    ``cluster="slurm-array:N"`` what was submitted (:class:`~.array.ArraySubmitted`)."""
    opts, run = split_options(model, kind, options)
    return run_job(store, opts, run, parse_cluster(cluster))   # a library caller's text: parsed here, once


def run_job(store: str | os.PathLike | FeatureStore, opts: ExtractOptions, run: Execution,
            cluster: ClusterSpec | None = None):
    """Run the job ``opts`` / ``run`` where ``cluster`` says (None: in-process; see module doc),
    holding the set's writer lock; a resumed set is checked first (:func:`resume_checks`)."""
    with handling():
        try:
            return _run_job(store, opts, run, cluster)
        except KeyboardInterrupt as exc:   # Ctrl-C, or an Interrupted without its own words yet
            if getattr(exc, "message", None):
                raise
            raise interrupted(exc, "interrupted before the extraction started; nothing new was written "
                                   "(rerun the same command to start again)") from None


def _run_job(store, opts: ExtractOptions, run: Execution, cluster: ClusterSpec | None):
    from ..devices import resolve_device

    run = run.checked()
    requested = str(run.device or "auto").strip().lower()
    # auto -> cuda|cpu here (an unusable device is one Error: line), or on the nodes (slurm: the GPUs are there)
    device = requested if cluster is not None and cluster.resolves_on_workers else resolve_device(run.device)
    if device != "auto" and not device.startswith("cuda") and opts.precision == "fp16":
        raise ValueError("--precision fp16 needs --device cuda (use fp32 or bf16 on CPU)")
    run = run.replace(device=device)
    store = store if isinstance(store, FeatureStore) else FeatureStore.open(store, mode="r+")
    if store.n_images == 0:
        raise StoreError(f"{store.path} has no images; ingest a dataset first")
    plan = opts.plan()
    name = opts.name or default_name(plan.model, opts.kind)
    extra = region_arrays(plan) if opts.kind == "regions" else None
    array = cluster is not None and cluster.is_array
    # object storage: the workers get the storage options with their tasks (in memory over dask's
    # connection; a job array's tasks in the environment of the sbatch / qsub process only, see
    # extract/array.py) and the rest of the credentials from their own environment (sbatch and qsub -V
    # pass the submitter's); nothing is written into a job script.
    store.sets.check_cluster(cluster, "extraction", arrays=True)
    images_url = remote.image_url(store)
    if images_url:   # bad credentials or a missing bucket: one line, before any block runs
        remote.check_root(images_url)
    with store.writer(name, stage="vsekit extract", multi=cluster is not None):
        plan = own_decoder(store, name, opts, plan, run.overwrite)
        if plan.decoder == "nvjpeg" and device != "auto":
            from . import gpu_decode

            gpu_decode.check_device(device)
        existed = store.has_features(name) and not run.overwrite
        # --overwrite of an existing set builds the new one beside it (fs.staged) and swaps on success;
        # a job array has no driver left to swap, so there the old set is replaced when the new one is made
        fs = store.create_features(name, plan.row_shape, plan.store_dtype, attrs=plan.attrs(),
                                   block_rows=run.rows_per_block(), extra=extra, overwrite=run.overwrite,
                                   beside=not array)
        if existed:
            resume_checks(fs, run.retry_failed)
        # the resolved device of the latest run and its float32 math (TF32 off; not part of the config hash)
        fs.update_attrs(device=device, **FLOAT32_RECORD)
        if plan.kind != "regions":   # how the pixels were made: libraries and versions (not settings)
            fs.update_attrs(decoding=decoder_attrs(plan.decoder))
        blocks = fs.pending_blocks()
        skipped = len(fs.blocks()) - len(blocks)
        # the tasks open the store as they reach it (on object storage with the same options) and write
        # under the token of this run's guard
        job = Job(store.sets.task_path(), fs.name, plan, run, lock_name=name, lock_token=store.sets.token(name),
                  storage_options=store.sets.options(), image_options=remote.options() if images_url else {})
        t0, reads = time.perf_counter(), dict(remote.STATS) if images_url else {}
        try:
            if array:   # no driver stays: see extract/array.py
                from .array import submit

                return submit(store, fs, job, cluster, fresh=not existed)
            if cluster is not None:
                from .distribute import run_on_dask

                runs, builds, info = run_on_dask(job, fs, blocks, cluster)
            else:
                runs, builds, info = run_in_process(job, fs, blocks, store)
            _record(fs, info, requested, cluster)
            refuse_pending(fs)
        except BaseException as exc:
            _discard_or_keep(store, fs, name, existed, exc)
            raise
        fs = store.commit(fs)
    counts = fs.counts()
    return ExtractResult(name=name, n_rows=fs.n_rows, done=counts["done"], failed=counts["failed"],
                         pending=counts["pending"], blocks_run=len(blocks), blocks_skipped=skipped,
                         seconds=time.perf_counter() - t0, images=sum(len(b) for b in blocks), errors=fs.errors(),
                         block_runs=runs, model_builds=builds, decoding=info.get("decoding", {}),
                         devices=sorted(info.get("devices", ())),
                         image_reads={k: v - reads.get(k, 0) for k, v in remote.STATS.items()} if images_url else {})


def refuse_pending(fs: FeatureSet) -> None:
    """A run that ends with rows it was asked to compute still pending (no failure reason: their blocks
    were never committed) has not done its job: one error line, exit 1, never a summary with exit 0."""
    pending = fs.counts()["pending"]
    if pending:
        kept = ("the old set stays as it was" if fs.staged else
                "the finished blocks are kept: rerun the same command to compute the rest")
        raise StoreError(f"{fs.name!r} in {fs.store.path}: {pending} of {fs.n_rows} rows are still pending after "
                         f"this run (their blocks were not committed, and no failure reason was given); {kept}")


def own_decoder(store: FeatureStore, name: str, opts: ExtractOptions, plan, overwrite: bool = False):
    """``plan`` with the decoder of the existing set ``name`` where ``--decoder`` is not given: a set
    keeps the decoder its settings record (``pil`` where they record none), so resuming or remaking it
    never changes its pixels (docs/extract.md, "Decoders")."""
    if opts.decoder is not None or plan.kind == "regions" or not store.has_features(name):
        return plan
    try:
        own = store.features(name).attrs.get("decoder", UNRECORDED_DECODER)
    except Exception:   # noqa: BLE001 - an unreadable set: creating or resuming it says what is wrong
        return plan
    if own == plan.decoder:
        return plan
    if overwrite:
        print(f"note: {name!r} is made again with its own decoder {own} (recorded in its settings; new sets "
              f"default to {plan.decoder}: give --decoder {plan.decoder} to change it)", file=sys.stderr)
    return dataclasses.replace(opts, decoder=own).plan()


def _record(fs: FeatureSet, info: dict, requested: str, cluster) -> None:
    """Record where the blocks ran; a cluster run that could have used a GPU but ran (partly) on CPU
    says so in one line, and the set records that line. (How they were decoded is the result's
    ``decoding``: it describes a run, not the set, so it stays out of the attrs.)"""
    notes = sorted(info.get("notes", ()))
    for line in notes:   # what the tasks could not apply as asked (extract/site.py): said and kept
        print(f"vsekit: note: {line}", file=sys.stderr, flush=True)
    attrs: dict[str, Any] = {"execution_notes": notes}
    devices = sorted(info.get("devices", ()))
    if devices:
        attrs["device"] = ",".join(devices)
    if cluster is not None and requested != "cpu" and "cpu" in devices:
        why = ("the cluster settings ask for no GPU (set gpus: 1 in the cluster settings)"
               if cluster.is_jobqueue and not cluster.uses_gpu(requested) else
               "its workers see no usable GPU")
        line = f"--device {requested} on --cluster {cluster}: tasks ran on CPU, not on a GPU: {why}"
        print(f"vsekit: note: {line}", file=sys.stderr, flush=True)
        attrs["device_note"] = line
    fs.update_attrs(**attrs)


def _discard_or_keep(store: FeatureStore, fs: FeatureSet, name: str, existed: bool, exc: BaseException) -> None:
    """After a failed run: a staged --overwrite is dropped, a set with nothing done is removed; an
    interrupt says what was kept (as :class:`~vsekit.interrupts.Interrupted`). A run that lost its lease
    on object storage touches nothing: the set belongs to the run that took it over."""
    from ..storage.objstore import LeaseLost

    if isinstance(exc, LeaseLost):   # one line: what happened (the exception's words) and what was kept
        c = fs.counts()
        raise LeaseLost(f"{exc}. Kept: {c['done']} done and {c['failed']} failed rows of {fs.n_rows} in "
                        f"{name!r}, each block whole; the run that took the set over writes the rest (or rerun "
                        f"the same command once it has stopped)") from None
    if fs.staged:   # a failed --overwrite: the old set stays as it was
        store.discard(fs)
        if isinstance(exc, KeyboardInterrupt):
            raise interrupted(exc, f"interrupted before the new {name!r} was finished; the old one is "
                                   f"kept as it was") from None
    elif not existed and fs.counts()["pending"] == fs.n_rows:
        store.delete_features(name)   # nothing done: a retry with other options is not refused
        if isinstance(exc, KeyboardInterrupt):
            raise interrupted(exc, f"interrupted before any row of {name!r} was done; nothing kept") from None
    elif isinstance(exc, KeyboardInterrupt):
        c = fs.counts()
        raise interrupted(exc, f"interrupted: kept {c['done']} done and {c['failed']} failed rows of {fs.n_rows} in "
                               f"{name!r} ({c['pending']} pending); rerun the same command to resume") from None


# --- in-process ----------------------------------------------------------------------------------
def run_in_process(job: Job, fs: FeatureSet, blocks, store: FeatureStore) -> tuple[dict, dict, dict]:
    """Every pending block in this process: one decoding pool over all of them, each finished block
    committed by the background writer (the guard: this run's writer lock)."""
    from tqdm.auto import tqdm

    if not blocks:
        return {}, {}, {}
    resolved = resolve(job.run, job.site)   # this process is where the blocks run
    extractor = extractor_for(job, resolved)
    guard = LockGuard(job, skip_committed=False, record_errors=True)
    runs: dict[int, int] = {}
    info: dict[str, Any] = {"decoding": {}, "devices": {resolved.run.device}, "notes": set(resolved.notes)}
    total = sum(len(b) for b in blocks)
    bar = tqdm(total=total, unit="img", desc=f"extract {fs.name}", disable=not job.run.progress, smoothing=0.1)
    tick = batch_progress(bar, min(total, resolved.run.batch_size))
    writer = BlockWriter(lambda buf: commit(fs, buf, guard))
    with handling(on_signal=_stop_decoders) as signals:
        try:
            for buf in compute_blocks(job, blocks, store=store, extractor=extractor, resolved=resolved,
                                      progress=tick):
                writer.submit(buf)
                runs[buf.block.index] = runs.get(buf.block.index, 0) + 1
                summary = decoding_summary(buf.decoders)
                if summary["decoders"] > info["decoding"].get("decoders", 0):
                    info["decoding"] = summary
        except KeyboardInterrupt:   # a Ctrl-C this thread's handler did not see first
            _stop_decoders()
            raise
        except RuntimeError as exc:   # torch noticed the workers _stop_decoders killed on a signal
            if signals.signum is not None:
                raise Interrupted("", signals.signum) from exc
            raise
        finally:
            bar.close()
            writer.close()
    return runs, {os.getpid(): 1}, info


def batch_progress(bar, first: int):
    """The bar moves per batch, and says what the current batch is doing: a dataset smaller than a
    batch (one batch in all) shows "decoding N images", then "model on N images", not a bar stuck at 0
    that jumps to 100%."""
    bar.set_postfix_str(f"decoding {first} image{'s' if first != 1 else ''}", refresh=True)

    def tick(event: str, n: int) -> None:
        if event == "decoded":
            bar.set_postfix_str(f"model on {n} image{'s' if n != 1 else ''}", refresh=True)
        else:
            bar.set_postfix_str("", refresh=False)
            bar.update(n)
    return tick


def _stop_decoders(signum: int | None = None) -> None:
    """On Ctrl-C or SIGTERM: end the decoding worker processes at once. Their graceful shutdown
    waits for each worker (torch joins with a 5 s timeout per worker, and a worker blocked on a full
    result pipe never answers), which made an interrupted extract take tens of seconds to exit."""
    try:
        for child in multiprocessing.active_children():
            child.kill()
        for child in multiprocessing.active_children():
            child.join(timeout=1)
    except RuntimeError:   # torch's SIGCHLD handler reporting the workers just killed
        pass


__all__ = ["ExtractResult", "Interrupted", "extract", "run_job", "default_name", "make_plan"]
