"""``--cluster slurm-array:N`` / ``sge-array:N``: one SLURM (or Grid Engine) job array whose tasks
write the feature set themselves; no scheduler and no driver stay behind.

The driver (:func:`submit`, called by ``extract`` while it holds the set's writer lock, after
creating or reopening the set as every other path does) writes the tasks' spec
(:mod:`vsekit.storage.job_arrays`), hands the set's guard over to the array and submits one array
job (the script is the scheduler's, :mod:`vsekit.schedulers`). Each task (``python -m
vsekit.extract.array SPEC``, or ``URL NAME`` on object storage: :func:`work`) claims pending blocks
by a lease each, extracts and commits them, and merges the failure reasons when none is left;
SIGTERM leaves the block in progress pending. The protocol and each guarantee's test:
docs/gpus_clusters.md, "Job arrays"; on object storage docs/store.md, "Job arrays on object storage".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..interrupts import Interrupted, handling
from ..schedulers import get
from ..storage import job_arrays as arrays
from ..storage.faults import point
from ..storage.leases import Lease, default_ttl, owner_record
from ..storage.sources.remote import image_url
from ..storage.store import Block, FeatureSet, FeatureStore, StoreError
from .rows import commit, compute_block

SBATCH_TIMEOUT_S = 60
#: the settings an array's script uses, besides the scheduler's own (its ``keys``)
ARRAY_KEYS = ("queue", "walltime", "cores", "memory", "gpus", "job_extra", "prologue", "python", "log_directory")


@dataclass
class ArraySubmitted:
    """What ``extract --cluster slurm-array:N`` did: the job it submitted (or that none was needed)."""

    name: str
    store: str
    n_rows: int
    done: int
    failed: int
    pending_blocks: int
    blocks: int
    tasks: int
    job_id: str | None = None
    log_dir: str | None = None
    scheduler: str = "slurm"

    def summary(self) -> str:
        sched = get(self.scheduler)
        if self.job_id is None:
            return (f"{self.name}: {self.done} done, {self.failed} failed, 0 pending of {self.n_rows} rows; "
                    f"nothing left to extract, no job submitted")
        return "\n".join([
            f"{self.name}: submitted {sched.label} job array {self.job_id} ({self.tasks} tasks) for "
            f"{self.pending_blocks} pending of {self.blocks} blocks ({self.done} rows done already)",
            f"  progress: vsekit info {self.store} {self.name}   (and: {sched.queue_hint(self.job_id)})",
            f"  task logs: {self.log_dir}",
            "  when the array has ended, the same command fills any block left pending"])


# --- the driver ------------------------------------------------------------------------------------
def array_gpus(settings: dict, device: str) -> int:
    """GPUs per array task: ``gpus`` (default 1 with a CUDA device, 0 otherwise)."""
    from ..devices import is_cuda

    return int(settings.get("gpus", 1 if is_cuda(device) else 0) or 0)


def job_script(spec_file: "Path | str", name: str, tasks: int, settings: dict, device: str, log_dir: Path,
               scheduler: str = "slurm") -> str:
    """The array's job script (sbatch, qsub...): the scheduler's header for ``tasks`` tasks, then one
    line of work, :func:`work`, for each task."""
    gpus = array_gpus(settings, device)
    if gpus > 1:
        raise ValueError(f"cluster setting gpus: {gpus}: an array task uses one GPU; use gpus: 1 and "
                         f"more tasks ({scheduler}-array:N)")
    lines, directive = get(scheduler).array_header(name, tasks, settings, gpus, log_dir)
    # the same end for every scheduler: the site's extra directives and prologue, then the task's work
    # on the spec (``spec_file``: its path, or for a store on object storage ``URL NAME``, task_args)
    lines = [*lines, *(f"{directive} {x}" for x in settings.get("job_extra") or []),
             *(str(x) for x in settings.get("prologue") or [])]
    python = settings.get("python") or sys.executable
    lines.append(f"exec {python} -m vsekit.extract.array {spec_file}")
    return "\n".join(lines) + "\n"


#: how an array on object storage gets this command's ``--storage-option`` values: in the environment
#: of the sbatch / qsub process only (the scheduler passes it to the tasks: sbatch's default
#: ``--export=ALL``, Grid Engine's ``-V``), never in the spec object, the job script, a log or the store;
#: each task takes it out of its environment at once (:func:`_take_storage_options`)
OPTIONS_ENV = "VSEKIT_ARRAY_STORAGE_OPTIONS"
IMAGE_OPTIONS_ENV = "VSEKIT_ARRAY_IMAGE_OPTIONS"   # the images' options (--image-option), handed so too


def _take_storage_options() -> None:
    from ..storage.objstore import DEFAULT_OPTIONS
    from ..storage.sources.remote import use_options

    raw = os.environ.pop(OPTIONS_ENV, None)
    if raw:
        DEFAULT_OPTIONS.update({str(k): str(v) for k, v in json.loads(raw).items()})
    raw = os.environ.pop(IMAGE_OPTIONS_ENV, None)
    if raw:
        use_options(json.loads(raw))


def submit(store: FeatureStore, fs: FeatureSet, job, cluster, fresh: bool) -> ArraySubmitted:
    """Submit the job array for ``fs``'s pending blocks (the caller holds the set's writer lock).

    ``cluster``: the ``slurm-array:N`` :class:`~vsekit.clusters.ClusterSpec` (its settings shape the
    jobs); ``fresh``: the set was created by this run (what an earlier array of the same name left
    in the store is removed).
    """
    tasks = cluster.n
    sched = cluster.scheduler
    scheduler = sched.name
    device = job.run.device
    where = arrays.place(store, fs.name)
    if fresh:
        where.remove()
    settings = {k: v for k, v in cluster.settings.items() if k in ARRAY_KEYS or k in sched.keys}
    if str(device) != "cpu" and array_gpus(settings, device) == 0:   # no silent CPU
        line = (f"--device {device} on --cluster {cluster}: the array tasks ask for no GPU, so they run "
                f"on CPU (set gpus: 1 in the cluster settings, or --device cuda)")
        print(f"vsekit: note: {line}", file=sys.stderr, flush=True)
        fs.update_attrs(device_note=line)
    merge_errors(fs)                     # a previous array's reasons, before anything else
    blocks = fs.pending_blocks()
    counts = fs.counts()
    result = ArraySubmitted(fs.name, str(store.path), fs.n_rows, counts["done"], counts["failed"],
                            len(blocks), len(fs.blocks()), tasks, scheduler=scheduler)
    if not blocks:
        return result
    sbatch = sched.tool(what=f"{cluster.kind}:{tasks}")
    where.clear_leases()   # a previous array has ended: we hold the set's lock (or lease)
    # scripts and logs: in the store's folder on a disk; a local folder for a store on object storage
    adir = where.scripts
    log_dir = Path(settings.get("log_directory") or adir / "logs").absolute()
    log_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    spec = dict(task_spec(store, fs, job, tasks, token), scheduler=scheduler)
    spec_file = adir / "spec.json"
    script = adir / f"job-{time.strftime('%Y%m%d-%H%M%S')}.sh"
    script.parent.mkdir(parents=True, exist_ok=True)
    # the task's arguments: the spec file on a disk; on object storage the store's URL (without
    # credentials) and the set's name (the spec is an object)
    args = f"{shlex.quote(store.path)} {shlex.quote(fs.name)}" if store.remote else str(spec_file)
    script.write_text(job_script(args, fs.name, tasks, settings, device, log_dir, scheduler))
    where.write_spec(spec)
    hand = {IMAGE_OPTIONS_ENV: json.dumps(job.image_options)} if job.image_options else {}
    if job.storage_options:   # object storage, for the sbatch / qsub process only: see OPTIONS_ENV
        hand[OPTIONS_ENV] = json.dumps(job.storage_options)

    def held_by(job_id: str | None) -> dict:   # the set's guard as the array's
        return {"array_job": job_id, "array_scheduler": scheduler,
                "stage": f"vsekit extract --cluster {scheduler}-array (job {job_id or 'being submitted'})"}
    hand_back = store.sets.hand_over(fs.name, token, held_by(None))
    try:
        out = subprocess.run([sbatch, *sched.array_flags, str(script)], capture_output=True, text=True,
                             timeout=SBATCH_TIMEOUT_S, env=dict(os.environ, **hand) if hand else None)
        if out.returncode != 0:
            why = " ".join(ln for ln in (out.stderr or out.stdout).split("\n") if ln.strip() != "Exiting.")
            why = " ".join(why.split()) or f"exit status {out.returncode}"
            raise ValueError(f"--cluster {cluster.kind}:{tasks}: {sched.submit} refused the job array: {why}")
        job_id = sched.array_job_id(out.stdout)
    except BaseException as exc:
        hand_back()   # the caller releases it as usual
        where.drop_spec()
        script.unlink(missing_ok=True)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise ValueError(f"--cluster {cluster.kind}:{tasks}: {sched.submit} did not answer in {SBATCH_TIMEOUT_S}s") from None
        raise
    spec["job_id"] = job_id
    where.write_spec(spec)
    store.sets.hand_over(fs.name, token, held_by(job_id))
    result.job_id, result.log_dir = job_id, str(log_dir)
    return result


def task_spec(store: FeatureStore, fs: FeatureSet, job, tasks: int, token: str) -> dict:
    """What every array task reads: the set (the store as the job's tasks open it), its plan and the
    whole Execution (``run``: every field, each task resolves it on its node, :func:`task_execution`)."""
    return {"store": job.store, "name": fs.name, "plan": job.plan.to_dict(),
            "run": dataclasses.asdict(job.run), "tasks": tasks, "ttl": default_ttl(),
            "config_hash": fs.attrs.get("config_hash"), "lock_token": token, "job_id": None,
            "submitted": time.time()}


def task_execution(spec: dict, cpus: int):
    """The spec's Execution resolved on this array task's node, ``cpus`` its ``--cpus-per-task``
    (:func:`vsekit.extract.site.resolve`; no progress bar in a batch log). A spec written before the
    whole Execution was kept holds only some of its fields; the rest take their defaults."""
    from .job import Execution, Site
    from .site import resolve

    if "run" in spec:
        run = Execution(**spec["run"])
    else:   # pragma: no cover - an array submitted by an older vsekit
        keys = ("device", "batch_size", "strict", "pin_memory", "channels_last")
        run = Execution(**{k: spec[k] for k in keys if k in spec})
    return resolve(run.replace(progress=False), Site("array", cpus))


# --- an array task ---------------------------------------------------------------------------------
def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] vsekit array task: {message}", file=sys.stderr, flush=True)


def claims(fs: FeatureSet, leases, task: int, tasks: int) -> Iterator[tuple[Lease, Block]]:
    """This task's blocks, each pending, leased by it and (re-checked) still pending: every status is
    read once per round, the pending blocks walked from this task's offset (task k of N starts k/N of
    the way in, so tasks rarely contend); waits while the only pending blocks are leased by live tasks."""
    blocks = fs.blocks()

    def pending() -> list[Block]:
        status = fs.status_values()
        out = [b for b in blocks if (status[b.start:b.stop] == 0).any()]
        start = task * len(out) // max(1, tasks)
        return out[start:] + out[:start]
    queue = pending()
    while queue:
        claimed = False
        for b in queue:
            lease = leases.claim(b.index)
            if lease is None:
                continue
            if fs.block_done(b) or _restored(fs, b):   # finished since this round's read
                leases.release(lease)
                continue
            claimed = True
            yield lease, b
        queue = pending()
        if queue and not claimed:   # all leased by others: wait for them to end or expire
            time.sleep(min(5.0, max(0.2, leases.ttl / 10)))
            queue = pending()


def _restored(fs: FeatureSet, block: Block) -> bool:
    """Object storage: a block with a commit record whose status was not written (a task killed
    between the two) gets its status from the record, and is done (:func:`objcommit.reconcile`)."""
    if not fs.store.remote:
        return False
    from ..storage import objcommit

    rec = objcommit.read_record(fs, block.index)
    if rec is None:
        return False
    fs.status[block.start:block.stop] = np.asarray(rec.get("status", []), dtype=np.uint8)
    say(f"block {block.index}: committed by an earlier task, its status restored from its commit record")
    return True


class LeaseGuard:
    """An array task may write a block while it holds the block's lease, the block is still pending,
    and the array still holds the set's guard (``hold``, :meth:`~vsekit.storage.sets.SetStorage.join`:
    its writer lock under the spec's token, or its lease on object storage, checked again before the
    commit record); a guard the array lost raises :class:`~vsekit.storage.objstore.LeaseLost`."""

    def __init__(self, leases, lease, hold=None):
        self.leases, self.lease, self.hold = leases, lease, hold

    def refuses(self, fs: FeatureSet, block: Block) -> str | None:
        if self.hold is not None:
            self.hold.check()
        self.leases.renew(self.lease)
        if not self.leases.held(self.lease):
            return "its lease was lost (expired and taken over)"
        if fs.block_done(block):
            return "another task committed it first"
        return None

    def write(self, fs: FeatureSet, buf) -> bool:
        if buf.errors:   # a file of their own: one task at a time merges them into the attrs
            arrays.place(fs.store, fs.name).write_errors(buf.block.index, {str(k): v for k, v in buf.errors.items()})
        return buf.write(fs, record_errors=False)   # data and checksums, then the status that marks it done


@contextlib.contextmanager
def _merging(fs: FeatureSet, tries: int = 1):
    """The merge lease of ``fs``'s array (one task at a time writes the set's attrs): yields True
    while held, False when ``tries`` claims 0.1 s apart did not get it."""
    guard = arrays.place(fs.store, fs.name).merge_leases()
    lease = guard.claim(0)
    for _ in range(tries - 1):
        if lease is not None:
            break
        time.sleep(0.1)
        lease = guard.claim(0)
    try:
        yield lease is not None
    finally:
        if lease is not None:
            guard.release(lease)


def merge_errors(fs: FeatureSet) -> int:
    """Move the failure reasons the tasks wrote into the set's attrs (one merger at a time)."""
    where = arrays.place(fs.store, fs.name)
    if not where.error_files():
        return 0
    with _merging(fs) as held:
        if not held:
            return 0
        files = where.error_files()   # under the lease: what no other merger took meanwhile
        merged: dict[int, str] = {}
        for _, reasons in files:
            with contextlib.suppress(ValueError):
                merged.update({int(k): v for k, v in reasons.items()})
        fs.store.features(fs.name).record_errors(merged)   # the attrs as they are now, not as this task opened them
        where.drop_errors([f for f, _ in files])
        return len(merged)


def record_notes(fs: FeatureSet, notes) -> None:
    """Keep what a task could not apply as asked in the set's attrs (``execution_notes``; one writer
    at a time, through the same lease as the failure reasons)."""
    if notes:
        with _merging(fs, tries=50) as held:
            if held:
                have = list(fs.store.features(fs.name).attrs.get("execution_notes") or [])
                fs.update_attrs(execution_notes=sorted(set(have) | set(notes)))


def work(spec_file: str | os.PathLike, task: int | None = None, name: str | None = None) -> int:
    """One array task: claim, extract and commit pending blocks until none is left; the exit status.
    ``spec_file``: the spec's path; or, for a store on object storage, the store's URL and ``name``
    the set's (the spec is an object of the store). ``task``: the task's number as its scheduler
    numbers it (default: from the environment), the number its log lines, lease records and fault
    points (``array-task-K``) use, so that ``scancel JOB_K`` / ``qdel JOB -t K`` and the log agree."""
    from ..storage.objstore import LeaseLost, is_object_url
    from .job import Job, Site
    from .plan import Plan

    _take_storage_options()   # this command's storage options (over the standard AWS_* ones), the images'
    if is_object_url(str(spec_file)):   # the store's URL: the spec is an object of the store
        store = FeatureStore.open(str(spec_file), mode="r+")
        spec = arrays.place(store, str(name)).read_spec()
        if spec is None:
            say(f"no job array spec for {name!r} in {store.path}; stopping")
            return 2
    else:
        spec = json.loads(Path(spec_file).read_text())
        store = FeatureStore.open(spec["store"], mode="r+")
    fs = store.features(spec["name"])
    if fs.attrs.get("config_hash") != spec["config_hash"]:
        say(f"{spec['name']!r} has other settings now (config_hash {fs.attrs.get('config_hash')}); stopping")
        return 2
    hold = store.sets.join(spec["name"], spec["lock_token"], float(spec["ttl"]))   # the array's, with its siblings
    try:
        hold.renew()
    except LeaseLost as exc:
        say(f"{exc}; stopping")
        return 2
    hold.keep_renewed(hold.ttl / 3, errors=(OSError, StoreError))
    sched = get(spec.get("scheduler"))
    if task is None:
        task = sched.task_number()
        task = sched.first_task if task is None else task
    resolved = task_execution(spec, sched.task_cpus())
    run = resolved.run
    for line in resolved.notes:
        say(f"note: {line}")
    record_notes(fs, resolved.notes)
    job = Job(spec["store"], spec["name"], Plan.from_dict(spec["plan"]), run, site=Site("array"))
    leases = arrays.place(store, spec["name"]).leases(ttl=spec["ttl"], owner=owner_record())
    committed, dropped, lease = 0, 0, None
    say(f"task {task} of job {leases.owner.get('job')} on {leases.owner['host']} (pid {os.getpid()}), "
        f"device {run.device}, {run.workers} decoding {'threads' if image_url(fs) else 'processes'}, {spec['name']!r}")
    try:
        with handling() as signals:   # SIGTERM: stop at once, except inside a commit (it finishes first)
            point(f"array-task-{task}:start")
            for lease, block in claims(fs, leases, task - sched.first_task, spec["tasks"]):
                lease.keep_renewed(max(0.05, min(leases.ttl / 6, 60.0)), errors=(OSError, StoreError))
                if lease.stolen_from:
                    o = lease.stolen_from
                    say(f"block {block.index}: took over the expired lease of job {o.get('job')} task {o.get('task')}")
                point(f"array-task-{task}:claimed")
                buf = compute_block(job, block, store=store, resolved=resolved)
                with signals.deferred():
                    why = commit(fs, buf, LeaseGuard(leases, lease, hold))
                    if why is None:
                        committed += 1
                        say(f"committed block {block.index} (rows {block.start}-{block.stop - 1}), decoded by "
                            f"{len({d.split(':')[0] for d in buf.decoders})} processes")
                    else:
                        dropped += 1
                        say(f"block {block.index} not committed: {why}")
                    leases.release(lease)
    except LeaseLost as exc:
        say(f"{exc}; stopping without committing")
        return 2
    except Interrupted as exc:
        what = "SIGTERM" if exc.exit_code == 143 else f"signal {exc.signum}"
        verb = "terminated" if exc.exit_code == 143 else "interrupted"
        say(f"{verb} ({what}) after committing {committed} block(s); the block in progress stays pending")
        return exc.exit_code
    finally:
        if lease is not None:
            leases.release(lease)   # the block in progress stays pending
        hold.release()   # stops renewing it: the array's guard outlives its tasks
    merge_errors(fs)
    say(f"no block left pending: committed {committed}, dropped {dropped}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m vsekit.extract.array SPEC.json | STORE_URL NAME (run by the job array)",
              file=sys.stderr)
        return 2
    return work(args[0], name=args[1] if len(args) == 2 else None)


if __name__ == "__main__":   # run the imported module's functions, not this __main__ copy's
    from vsekit.extract.array import main as _main

    sys.exit(_main())
