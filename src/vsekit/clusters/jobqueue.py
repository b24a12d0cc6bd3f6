"""Jobs of a batch scheduler as dask workers: ``--cluster slurm:N``, ``sge:N``, ``pbs:N``, ``lsf:N``,
``htcondor:N`` through dask-jobqueue, kept at N jobs adaptively; workers retire before their
walltime, the job script is checked before anything is submitted, and the run's jobs are cancelled
by id when it ends (docs/gpus_clusters.md). A job with G GPUs runs G single-threaded workers, each
pinned to one (:mod:`vsekit.cluster_pin`). What differs between schedulers is in
:mod:`vsekit.schedulers`.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from typing import Any, Iterator, Mapping

from ..schedulers import SCHEDULERS, get
from ..schedulers.base import job_cores, job_memory
from .local import NO_PAUSE
from .spec import ClusterSpec

NO_PAUSE_EXPORT = [f"export {k}={v}" for k, v in NO_PAUSE.items()]


def lifetime_args(walltime: Any, lifetime: Any = None, kind: str = "slurm") -> list[str]:
    """``--lifetime``/``--lifetime-stagger`` so that a worker retires before its job's walltime.

    The margin is a tenth of the walltime, at least 20 s and at most 10 minutes; workers retire at
    ``walltime - margin`` give or take a quarter of the margin, so a job's workers do not all leave
    at once. ``lifetime`` (seconds) overrides the computed value. ``walltime`` is read in the syntax
    of the scheduler ``kind`` (SLURM: a bare number is minutes; Grid Engine ``h_rt``: seconds).
    """
    total = get(kind).seconds(str(walltime).strip()) if walltime else None   # None: unread (e.g. INFINITY), no lifetime
    if lifetime is not None:
        life = int(lifetime)
    elif total is None:
        return []
    else:
        life = total - min(600, max(20, total // 10))
    if life < 10:
        raise ValueError(f"cluster setting walltime {walltime!r} leaves a worker under 10 s to live")
    stagger = max(1, min(300, (total - life if total else life // 10) // 4))
    return ["--lifetime", f"{life}s", "--lifetime-stagger", f"{stagger}s"]


def jobqueue_kwargs(kind: str, settings: Mapping[str, Any], device: str,
                    resources: Mapping[str, float] | None) -> dict:
    """The dask-jobqueue cluster class's keyword arguments for the scheduler ``kind`` from vsekit's
    cluster settings (:data:`CLUSTER_KEYS`).

    Every worker is single-threaded (one task at a time); ``cores`` are the job's CPUs and its
    workers' decoding threads. A job with ``gpus: G`` (only with a CUDA or ``auto`` device) asks the
    scheduler for G GPUs and runs G workers, each pinned to one GPU. How each request is written is
    the scheduler's (:meth:`~vsekit.schedulers.base.Scheduler.requests`).
    """
    sched = get(kind)
    s = dict(settings)
    for key in s:
        owners = [k for k, o in SCHEDULERS.items() if key in o.keys]
        if owners and kind not in owners:
            raise ValueError(f"cluster setting {key!r} is for {' and '.join(SCHEDULERS[k].label for k in owners)} "
                             f"only, not {sched.label}")
    gpus = ClusterSpec(kind, 1, settings=s).gpus_per_job(device)
    s.pop("gpus", None)
    cores = int(s.pop("cores", 0) or 0) or job_cores(gpus)
    processes = int(s.pop("processes", gpus or cores))
    if gpus and processes != gpus:
        raise ValueError(f"cluster settings gpus: {gpus} and processes: {processes}: a job runs one worker "
                         f"per GPU; leave processes out or set it to {gpus}")
    if processes < 1 or cores < processes:
        raise ValueError(f"cluster settings cores: {cores}, processes: {processes}: need 1 <= processes <= cores")
    memory = s.pop("memory", None) or job_memory(gpus)
    kw: dict[str, Any] = {"cores": processes, "processes": processes, "memory": memory,
                          "job_extra_directives": list(s.pop("job_extra", []) or []),
                          # a paused worker starts no task: a block would wait forever (see NO_PAUSE)
                          "job_script_prologue": [*NO_PAUSE_EXPORT, *list(s.pop("prologue", []) or [])],
                          "silence_logs": "error",
                          # no dashboard, and its HTTP server (health, metrics) on a free port: the
                          # default 8787 is often taken on a shared login node, and distributed then
                          # prints a warning beside the run's one-line messages
                          "scheduler_options": {"dashboard": False, "dashboard_address": ":0"}}
    extra: list[str] = []   # cores == processes: dask-jobqueue passes --nthreads 1 itself
    res = dict(resources or {})
    if gpus:
        res["GPU"] = 1
        extra += ["--preload", "vsekit.cluster_pin"]
    else:
        res.pop("GPU", None)
    if res:
        extra += ["--resources", ",".join(f"{k}={v:g}" for k, v in res.items())]
    if s.get("walltime") and not sched.walltime:
        raise ValueError(f"cluster setting walltime: {sched.label} jobs take no walltime here; use lifetime (seconds)")
    # the walltime the job will have: the setting, else dask-jobqueue's configuration (its default
    # 00:30:00 for SLURM, Grid Engine, PBS, LSF): the workers retire before it either way
    walltime = s.get("walltime") or (_configured_walltime(kind) if sched.walltime else None)
    extra += lifetime_args(walltime, s.pop("lifetime", None), kind)
    kw["worker_extra_args"] = extra
    s.pop("start_timeout", None)
    sched.requests(kw, s, cores, gpus, memory)
    for key in ("queue", "account", "project", "walltime", "interface", "python", "log_directory",
                "local_directory"):
        if key in s:
            kw[key] = s.pop(key)
    if "host" in s:
        kw["scheduler_options"]["host"] = s.pop("host")
    return kw


def _configured_walltime(kind: str) -> Any:
    try:
        import_jobqueue(get(kind).cluster)   # its defaults enter dask's configuration on import
    except ImportError:
        return None
    import dask

    return dask.config.get(f"jobqueue.{kind}.walltime", None)


def import_jobqueue(name: str = "SLURMCluster"):
    """The dask-jobqueue cluster class ``name``, without dask-jobqueue 0.9.0's ``signal.signal(SIGINT, ...)``.

    Its ``runner`` module replaces the Ctrl-C handler with one that exits 0 (dask-jobqueue issue
    #696), and fails to import off the main thread (``signal.signal`` raises there). While it is
    imported, ``signal.signal`` leaves SIGINT alone.
    """
    if "dask_jobqueue" not in sys.modules:
        real = signal.signal

        def keep_sigint(signum, handler):
            if signum == signal.SIGINT:
                return signal.getsignal(signal.SIGINT)
            return real(signum, handler)

        with _SIGNAL_PATCH:
            signal.signal = keep_sigint
            try:
                import dask_jobqueue  # noqa: F401
            finally:
                signal.signal = real
    import dask_jobqueue

    return getattr(dask_jobqueue, name)


_SIGNAL_PATCH = threading.Lock()


def job_ids(cluster) -> list[str]:
    """The scheduler's job ids of the cluster's current jobs."""
    return [str(j.job_id) for j in list(getattr(cluster, "workers", {}).values())
            if getattr(j, "job_id", None)]


def wait_for_workers(cluster, n: int, timeout: float, kind: str) -> None:
    """Wait until one worker runs (dask's own wait); after ``timeout`` s, a ValueError with the jobs' states."""
    try:
        cluster.wait_for_workers(1, timeout=timeout)
    except TimeoutError:
        sched = get(kind)
        raise ValueError(f"--cluster {kind}:{n}: no {sched.label} job started within {timeout:g} s "
                         f"(start_timeout); {sched.status}: {sched.pending_reasons(job_ids(cluster))}") from None


@contextlib.contextmanager
def start(kind: str, n: int, device: str, resources, settings: Mapping[str, Any]) -> Iterator[Any]:
    """``n`` jobs of the scheduler ``kind`` as a dask cluster, their jobs cancelled when it ends."""
    sched = get(kind)
    try:
        cls = import_jobqueue(sched.cluster)
    except ImportError:
        raise ValueError(f"--cluster {kind}:N needs dask-jobqueue: pip install 'vsekit[slurm]'") from None
    s = dict(settings)
    timeout = float(s.get("start_timeout", 600))
    kw = jobqueue_kwargs(kind, s, device, resources)
    sched.tool()
    _quiet_job_logs()
    try:
        cluster = cls(**kw)
    except (OSError, RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"--cluster {kind}:{n}: cannot start the dask scheduler for {sched.label} ({exc})") from exc
    seen: set[str] = set()
    adaptive = None
    try:
        sched.check_submission(cluster.job_script(), n)
        adaptive = cluster.adapt(minimum_jobs=n, maximum_jobs=n)
        _track_jobs(cluster, seen, timeout)
        wait_for_workers(cluster, n, timeout, kind)
        yield cluster
    finally:
        if adaptive is not None:
            with contextlib.suppress(Exception):
                adaptive.stop()
        seen.update(job_ids(cluster))
        sched.cancel_jobs(sorted(seen))   # by id: this run's jobs only, before dask's slower close
        with contextlib.suppress(Exception):
            cluster.close(timeout=30)


def _track_jobs(cluster, seen: set[str], timeout: float) -> None:
    """Remember every job id the cluster submits (adapt replaces jobs), from a daemon thread."""
    def watch():
        while cluster.status.name not in ("closing", "closed", "failed"):
            seen.update(job_ids(cluster))
            time.sleep(0.5)

    threading.Thread(target=watch, name="vsekit-cluster-jobs", daemon=True).start()


def _quiet_job_logs() -> None:
    """dask logs a failed job start as a long traceback on every adapt cycle; vsekit reports it once."""
    import logging

    for name in ("distributed.deploy.adaptive", "distributed.deploy.adaptive_core",
                 "distributed.deploy.spec", "tornado.application"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
