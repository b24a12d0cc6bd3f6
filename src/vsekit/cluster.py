"""Where stages run: in-process, a local dask cluster (``local:N``), SLURM jobs (``slurm:N``), Grid
Engine jobs (``sge:N``; ``pbs:N``, ``lsf:N``, ``htcondor:N`` the same way, tested on stand-ins) or a running
scheduler (``tcp://``). ``slurm-array:N`` (an sbatch job array, no driver) is parsed here
and run by its own module.

Only this module imports ``distributed`` (and ``dask_jobqueue``), and only when a cluster is asked for.

- ``local:N`` starts N single-threaded worker processes on 127.0.0.1. With a CUDA device each worker
  is pinned to one GPU (``CUDA_VISIBLE_DEVICES``, round-robin, see :func:`vsekit.devices.gpu_assignment`)
  and declares the resource ``GPU=1``, so one task at a time runs per GPU.
- ``slurm:N`` keeps N SLURM jobs running through dask-jobqueue's ``SLURMCluster`` (``pip install
  vsekit[slurm]``), adaptively (``adapt(minimum_jobs=N, maximum_jobs=N)``): a job that ends (its
  walltime, a preemption, ``scancel``) is replaced. With a walltime, each worker retires itself
  before it (``--lifetime``, staggered), so its job ends cleanly and a fresh one takes over. The job
  is checked with ``sbatch --test-only`` first, so a refused submission is one error with sbatch's
  message; if no job starts within ``start_timeout`` seconds the run stops with squeue's reason.
  The run's jobs are cancelled by id when it ends, also on Ctrl-C and SIGTERM. A job with G GPUs
  runs G single-threaded workers, each pinned to one of them (:mod:`vsekit.cluster_pin`); its
  ``cores`` are the decoding threads of its workers. The device is resolved on the workers.
  ``--cluster`` is parsed once, at the edge (:func:`parse_cluster` → :class:`ClusterSpec`, settings
  included): the settings are the caller's (``vsekit run`` passes its pipeline's ``cluster:``
  section), else the user's ``$VSEKIT_CLUSTER_CONFIG`` (JSON, read here only); dask-jobqueue's own
  config fills the rest. The parsed spec is what every stage receives. A GPU job gets 6 cores and 16 GB per GPU
  unless its settings say otherwise, and no vsekit worker pauses for memory (:data:`NO_PAUSE`).
- ``sge:N``, ``pbs:N``, ``lsf:N``, ``htcondor:N``: the same as ``slurm:N`` through dask-jobqueue's
  ``SGECluster`` / ``PBSCluster`` / ``LSFCluster`` / ``HTCondorCluster``. What differs between
  schedulers (walltime syntax, how cores, memory and GPUs are requested, the early check: Grid
  Engine ``qsub -w v``, the commands that cancel and list jobs) is one entry each of
  :data:`SCHEDULERS`; SLURM and Grid Engine are tested on real schedulers, PBS on a stand-in whose
  ``qsub`` runs the job script at once (``tests/test_jobqueue_standins.py``), LSF and HTCondor on stand-ins
  of ``bsub`` and ``condor_submit`` that start the job as their scheduler would
  (``tests/test_jobqueue_standins.py``); none of these three on a real server.
- ``tcp://HOST:PORT`` joins a scheduler whose workers were started elsewhere (``dask worker ...
  --resources GPU=1`` for GPU workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .devices import gpu_assignment, is_cuda, worker_device

SPEC_HELP = ("local:N (N worker processes here) | slurm:N (N SLURM jobs) | slurm-array:N (an sbatch "
             "job array of N tasks, no driver) | sge:N (N Grid Engine jobs; pbs:N, lsf:N, htcondor:N "
             "likewise, tested on stand-ins only) | sge-array:N (a qsub -t job array) | tcp://HOST:PORT (a running dask scheduler)")
ENV_SETTINGS = "VSEKIT_CLUSTER_CONFIG"
# the keys of a `cluster:` section (pipelines.yaml) and of `settings`, with what they mean
CLUSTER_KEYS = {
    "queue": "SLURM partition (-p), Grid Engine / PBS / LSF queue (-q)",
    "account": "SLURM / PBS account (-A)",
    "walltime": "job time limit, HH:MM:SS (SLURM -t, Grid Engine -l h_rt, PBS -l walltime; LSF -W [HH:]MM only)",
    "cores": "CPU cores per job (and decoding threads of its worker)",
    "memory": "memory per job, e.g. 16GB",
    "gpus": "GPUs per job (--gres=gpu:G, only with a CUDA device): G workers, one pinned per GPU",
    "processes": "dask worker processes per job (default: cores on CPU, one per GPU with GPUs)",
    "lifetime": "seconds a worker lives before it retires and its job is replaced (default: from walltime)",
    "start_timeout": "seconds to wait for the first job to start before giving up (default 600)",
    "host": "address the scheduler listens on (default: dask-jobqueue's choice)",
    "interface": "network interface of scheduler and workers, e.g. ib0",
    "python": "python executable on the nodes (default: this one)",
    "log_directory": "folder for the jobs' stdout/stderr",
    "local_directory": "fast node-local scratch folder for the workers",
    "job_extra": "extra #SBATCH lines, a list (e.g. ['--constraint=a100'])",
    "prologue": "shell lines run before the worker, a list (e.g. ['module load cuda'])",
    "project": "Grid Engine / LSF project (-P)",
    "pe": "Grid Engine parallel environment for jobs of more than one core (-pe PE cores)",
    "memory_resource": "Grid Engine resource that requests memory per job (default: none is requested; e.g. h_vmem)",
    "gpu_resource": "Grid Engine resource that requests GPUs (default gpu: -l gpu=G)",
    "disk": "HTCondor disk per job (default 1GB)",
}
SLURM_KEYS = CLUSTER_KEYS   # the name older callers import
#: driverless job arrays: the scheduler of each (an entry of SCHEDULERS)
ARRAY_KINDS = {"slurm-array": "slurm", "sge-array": "sge"}


@dataclass(frozen=True)
class ClusterSpec:
    """``--cluster``, parsed once at the edge (the CLI, ``vsekit run``, a library call) and passed on.

    ``kind``: local | slurm | sge | pbs | lsf | htcondor | slurm-array | tcp; ``n``: workers, jobs or
    array tasks; ``address``: the scheduler of ``tcp://``; ``settings``: the batch scheduler's
    settings (checked against :data:`CLUSTER_KEYS`).
    """

    kind: str
    n: int = 0
    address: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    text: str = ""

    def __str__(self) -> str:
        return self.text

    @property
    def is_array(self) -> bool:
        """A driverless job array (``slurm-array:N``, ``sge-array:N``: :mod:`vsekit.extract.array`)."""
        return self.kind in ARRAY_KINDS

    @property
    def is_jobqueue(self) -> bool:
        """Whether the workers are jobs of a batch scheduler (an entry of :data:`SCHEDULERS`)."""
        return self.kind in SCHEDULERS

    @property
    def resolves_on_workers(self) -> bool:
        """Whether ``--device`` is resolved on the cluster's nodes, not here: a batch scheduler's jobs
        (a login node may have no GPU) and a running scheduler's workers (``tcp://``, started elsewhere)."""
        return self.is_jobqueue or self.is_array or self.kind == "tcp"

    def gpus_per_job(self, device: str) -> int:
        """GPUs per SLURM job: ``gpus`` (default 1) with ``cuda``/``cuda:N``, ``gpus`` with ``auto``, 0 on CPU."""
        device = str(device or "auto").lower()
        if device == "cpu":
            return 0
        if is_cuda(device):
            return int(self.settings.get("gpus", 1) or 1)
        return int(self.settings.get("gpus", 0) or 0)

    def uses_gpu(self, device: str) -> bool:
        """Whether the tasks run on GPUs (and ask for the resource ``GPU=1``)."""
        if self.is_jobqueue:
            return self.gpus_per_job(device) > 0
        return is_cuda(device)

    def task_device(self, device: str) -> str:
        """The ``device`` a task gets; it resolves it on its worker. Pinned GPU workers (local, SLURM)
        see their one GPU as ``cuda``; a SLURM job without GPUs runs on its CPUs whatever the node has."""
        if self.kind == "local":
            return worker_device(device)
        if self.is_jobqueue:
            if not self.uses_gpu(device):
                return "cpu"
            return "cuda" if is_cuda(device) else "auto"
        return device

    def task_cpus(self, device: str = "cpu", cpus: int | None = None) -> int | None:
        """The CPU cores of one task (a dask worker is single-threaded: its decoding threads share
        them): a SLURM job's ``cores`` shared by its workers; ``local:N``: this machine's cores
        shared by the N workers; ``tcp://``: None, the cores of each worker, seen there. The task
        sizes its decoding from them (:func:`vsekit.extract.site.resolve`)."""
        if self.kind == "tcp":
            return None
        if self.kind == "local":
            cpus = cpus if cpus is not None else (os.cpu_count() or 1)
            return max(1, cpus // max(1, self.n))
        s = self.settings
        gpus = self.gpus_per_job(device) if self.is_jobqueue else 0
        cores = int(s.get("cores", 0) or 0) or job_cores(gpus)
        workers = int(s.get("processes", 0) or 0) or (gpus or int(s.get("gpus", 0) or 0) or cores)
        return max(1, cores // max(1, workers))


#: a GPU worker's host resources by default: decoding 10-crop images for one GPU takes ~6 cores
#: (docs/gpus_clusters.md), and its batches, pinned buffers and decoders need memory beyond 4 GB
CORES_PER_GPU, MEMORY_PER_GPU_GB, MEMORY_DEFAULT = 6, 16, "4GB"


def job_cores(gpus: int) -> int:
    """Default ``cores`` of a SLURM job (or array task) with ``gpus`` GPUs: 6 per GPU, else 1."""
    return CORES_PER_GPU * gpus if gpus else 1


def job_memory(gpus: int) -> str:
    """Default ``memory`` of a SLURM job (or array task) with ``gpus`` GPUs: 16 GB per GPU, else 4 GB."""
    return f"{MEMORY_PER_GPU_GB * gpus}GB" if gpus else MEMORY_DEFAULT


def parse_cluster(spec: "str | ClusterSpec | None", settings: Mapping[str, Any] | None = None) -> ClusterSpec | None:
    """``None``/``""`` → None; ``local:N``, ``slurm:N``, ``slurm-array:N``, ``tcp://HOST:PORT`` → a
    :class:`ClusterSpec` (a ClusterSpec is returned as it is). SLURM settings: ``settings`` (``vsekit
    run``: its pipeline's ``cluster:``), else ``$VSEKIT_CLUSTER_CONFIG`` (the user's; read here only)."""
    if isinstance(spec, ClusterSpec):
        return spec
    if not spec:
        return None
    text = str(spec)
    if text.startswith("tcp://"):
        return ClusterSpec("tcp", 0, text, {}, text)
    kind, _, count = text.partition(":")
    what = {"local": "worker processes", **{k: "array tasks" for k in ARRAY_KINDS},
            **{k: f"{sched.label} jobs" for k, sched in SCHEDULERS.items()}}
    if kind not in what:
        raise ValueError(f"--cluster {text!r}: expected {SPEC_HELP}")
    n = int(count) if count.isdigit() else 0
    if n < 1:
        raise ValueError(f"--cluster {text!r}: expected {kind}:N with N >= 1 {what[kind]}")
    found = cluster_settings(settings) if kind != "local" else {}
    return ClusterSpec(kind, n, None, found, text)


def cluster_settings(settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``settings``, else the JSON in ``$VSEKIT_CLUSTER_CONFIG``, checked against :data:`CLUSTER_KEYS`."""
    if settings is None:
        raw = os.environ.get(ENV_SETTINGS)
        try:
            settings = json.loads(raw) if raw else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"${ENV_SETTINGS} is not JSON: {exc}") from None
    if not isinstance(settings, Mapping):
        raise ValueError(f"cluster settings must be a mapping of {', '.join(CLUSTER_KEYS)}")
    out = {}
    for key, value in settings.items():
        k = str(key).replace("-", "_")
        if k not in CLUSTER_KEYS:
            raise ValueError(f"cluster setting {key!r} is unknown; valid: {', '.join(CLUSTER_KEYS)}")
        out[k] = value
    return out


# --- local:N ----------------------------------------------------------------------------------------
def local_worker_env(n_workers: int, device: str, n_gpus: int, visible: str | None) -> list[dict[str, str]]:
    """The extra environment of each local worker: its own GPU on a CUDA device, nothing on CPU.

    ``n_gpus``: the GPUs this process sees; ``visible``: its ``CUDA_VISIBLE_DEVICES``. GPU k of the
    assignment is the k-th visible one, so a job already restricted to GPUs "2,3" uses 2 and 3.
    """
    if not is_cuda(device):
        return [{} for _ in range(n_workers)]
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    out = []
    for gpu in gpu_assignment(n_workers, device, n_gpus):
        real = ids[int(gpu)] if ids and int(gpu) < len(ids) else gpu
        out.append({"CUDA_VISIBLE_DEVICES": str(real)})
    return out


def local_worker_specs(n_workers: int, device: str, resources: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """``distributed.SpecCluster`` worker specs: single-threaded nannies, each with its env (its GPU,
    of those this process sees) and resources."""
    from distributed import Nanny

    from .devices import cuda_count

    n_gpus = cuda_count() if is_cuda(device) else 0
    specs = {}
    for k, env in enumerate(local_worker_env(n_workers, device, n_gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))):
        options: dict[str, Any] = {"nthreads": 1, "host": "127.0.0.1", "dashboard_address": None,
                                   "resources": dict(resources or {}), "silence_logs": 40,
                                   "env": {**NO_PAUSE, **env}}
        specs[f"vsekit-{k}"] = {"cls": Nanny, "options": options}
    return specs


@contextlib.contextmanager
def _local(n: int, device: str, resources) -> Iterator[Any]:
    from distributed import Scheduler, SpecCluster

    if is_cuda(device) and _has_dask_cuda() and ":" not in device:
        import dask
        from dask_cuda import LocalCUDACluster  # one worker per GPU, pinned by dask-cuda itself

        with dask.config.set({"distributed.worker.memory.pause": False}), LocalCUDACluster(n_workers=n, threads_per_worker=1, host="127.0.0.1",
                              dashboard_address=None, resources=dict(resources or {})) as cluster:
            yield cluster
        return
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}}
    with SpecCluster(workers=local_worker_specs(n, device, resources), scheduler=scheduler,
                     silence_logs=40) as cluster:
        yield cluster


def _has_dask_cuda() -> bool:
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        return False
    return True


# --- jobs of a batch scheduler: slurm:N, sge:N, pbs:N, lsf:N, htcondor:N --------------------------
def _clock(text: str, bare: int) -> int | None:
    """``[D-]HH:MM:SS`` / ``MM:SS`` (or, with ``bare``, a plain number times ``bare`` seconds)."""
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        if not d.isdigit():
            return None
        days = int(d)
    parts = text.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (len(parts) == 1 and not bare):
        return None
    nums = [int(p) for p in parts]
    if len(nums) == 1:
        return days * 86400 + nums[0] * bare
    if len(nums) == 2:
        return days * 86400 + nums[0] * 60 + nums[1]
    return days * 86400 + nums[0] * 3600 + nums[1] * 60 + nums[2]


def _slurm_seconds(text: str) -> int | None:
    return _clock(text, 60)   # sbatch -t 30: minutes


def _sge_seconds(text: str) -> int | None:
    return None if "-" in text else _clock(text, 1)   # h_rt=HH:MM:SS or seconds


def _lsf_seconds(text: str) -> int | None:
    """bsub -W [HH:]MM[/HOST]: a bare number is minutes; HH:MM:SS or days are no LSF run limit."""
    text = text.split("/", 1)[0]
    if "-" in text or text.count(":") > 1:
        return None
    hm = _clock(text, 60)
    return hm * 60 if hm is not None and ":" in text else hm


@dataclass(frozen=True)
class Scheduler:
    """One batch scheduler, as vsekit drives it through dask-jobqueue: the one place where what
    differs between SLURM, Grid Engine, PBS, LSF and HTCondor is written down.

    ``submit`` / ``cancel`` / ``status``: its commands; ``cluster``: the dask-jobqueue class;
    ``seconds``: its walltime syntax read as seconds (None: it has no walltime); ``check``: the
    arguments that verify a job script without running it (None: no early refusal, the start
    timeout reports); ``tested``: whether a test runs it on the real scheduler here.
    """

    kind: str
    label: str
    cluster: str
    submit: str
    cancel: str
    status: str
    seconds: Any = None
    check: tuple[str, ...] | None = None
    tested: bool = False
    keys: tuple[str, ...] = ()   # settings only this scheduler takes

    def job_ids(self, cluster) -> list[str]:
        return job_ids(cluster)


SCHEDULERS: dict[str, Scheduler] = {s.kind: s for s in (
    Scheduler("slurm", "SLURM", "SLURMCluster", "sbatch", "scancel", "squeue", _slurm_seconds,
              ("--test-only",), tested=True, keys=("account",)),
    Scheduler("sge", "Grid Engine", "SGECluster", "qsub", "qdel", "qstat", _sge_seconds,
              ("-w", "v"), tested=True, keys=("project", "pe", "memory_resource", "gpu_resource")),
    Scheduler("pbs", "PBS", "PBSCluster", "qsub", "qdel", "qstat", lambda t: None if "-" in t else _clock(t, 1),
              keys=("account",)),
    Scheduler("lsf", "LSF", "LSFCluster", "bsub", "bkill", "bjobs", _lsf_seconds, keys=("project",)),
    Scheduler("htcondor", "HTCondor", "HTCondorCluster", "condor_submit", "condor_rm", "condor_q",
              None, keys=("disk",)),
)}


def _seconds(walltime: Any, kind: str = "slurm") -> int | None:
    """``walltime`` in ``kind``'s syntax as seconds (None if it cannot be read)."""
    read = SCHEDULERS[kind].seconds
    return read(str(walltime).strip()) if read else None


def lifetime_args(walltime: Any, lifetime: Any = None, kind: str = "slurm") -> list[str]:
    """``--lifetime``/``--lifetime-stagger`` so that a worker retires before its job's walltime.

    The margin is a tenth of the walltime, at least 20 s and at most 10 minutes; workers retire at
    ``walltime - margin`` give or take a quarter of the margin, so a job's workers do not all leave
    at once. ``lifetime`` (seconds) overrides the computed value. ``walltime`` is read in the syntax
    of the scheduler ``kind`` (SLURM: a bare number is minutes; Grid Engine ``h_rt``: seconds).
    """
    total = _seconds(walltime, kind) if walltime else None   # None: unread (e.g. INFINITY), no lifetime
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


#: dask pauses a worker at 80% of its memory limit, and a paused worker starts no task: a run whose
#: blocks need more than that would hang. vsekit's workers never pause (terminating at 95% stays: a
#: block that really exhausts memory ends its worker, and its rows are bisected).
NO_PAUSE = {"DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False"}
NO_PAUSE_EXPORT = [f"export {k}={v}" for k, v in NO_PAUSE.items()]


def sge_memory(memory: str) -> str:
    """dask's ``16GB`` as Grid Engine writes memory (``16G``: K, M, G are powers of 1024 there)."""
    from dask.utils import parse_bytes

    return f"{max(1, -(-parse_bytes(memory) // 2**20))}M"


def jobqueue_kwargs(kind: str, settings: Mapping[str, Any], device: str,
                    resources: Mapping[str, float] | None) -> dict:
    """The dask-jobqueue cluster class's keyword arguments for the scheduler ``kind`` from vsekit's
    cluster settings (:data:`CLUSTER_KEYS`).

    Every worker is single-threaded (one task at a time); ``cores`` are the job's CPUs and its
    workers' decoding threads. A job with ``gpus: G`` (only with a CUDA or ``auto`` device) asks the
    scheduler for G GPUs and runs G workers, each pinned to one GPU. How each request is written:
    SLURM ``--cpus-per-task``, ``--mem``, ``--gres=gpu:G``; Grid Engine ``-pe PE cores`` (only with
    more than one core, ``pe`` names the site's parallel environment), ``-l MEMORY_RESOURCE=...``
    (only if ``memory_resource`` names the site's resource: Grid Engine has no standard one, and a
    load value such as ``mem_free`` fails ``qsub -w v``), ``-l GPU_RESOURCE=G`` (default ``gpu``), ``-V`` (the job sees the
    submitting environment, as with sbatch); PBS, LSF, HTCondor: dask-jobqueue's own requests.
    """
    sched = SCHEDULERS[kind]
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
    if s.get("walltime") and sched.seconds is None:
        raise ValueError(f"cluster setting walltime: {sched.label} jobs take no walltime here; use lifetime (seconds)")
    if kind == "lsf" and s.get("walltime") and _lsf_seconds(str(s["walltime"]).strip()) is None:
        # bsub refuses any other run limit ("Bad RUNLIMIT specification"), and the jobs would never start
        raise ValueError(f"cluster setting walltime {s['walltime']!r}: LSF takes [HH:]MM (bsub -W), e.g. 01:30")
    # the walltime the job will have: the setting, else dask-jobqueue's configuration (its default
    # 00:30:00 for SLURM, Grid Engine, PBS, LSF): the workers retire before it either way
    walltime = s.get("walltime") or (_configured_walltime(kind) if sched.seconds else None)
    extra += lifetime_args(walltime, s.pop("lifetime", None), kind)
    kw["worker_extra_args"] = extra
    s.pop("start_timeout", None)
    pe = s.pop("pe", None)
    memory_resource = s.pop("memory_resource", None)
    gpu_resource = s.pop("gpu_resource", "gpu")
    if kind == "slurm":
        kw["job_cpu"] = cores
        if gpus:
            kw["job_extra_directives"].append(f"--gres=gpu:{gpus}")
    elif kind == "sge":
        requests = [f"{memory_resource}={sge_memory(memory)}"] if memory_resource else []
        if gpus:
            requests.append(f"{gpu_resource}={gpus}")
        if requests:
            kw["resource_spec"] = ",".join(requests)
        if cores > 1:
            if not pe:
                raise ValueError(f"cluster settings cores: {cores} on Grid Engine need pe: the name of the "
                                 f"site's parallel environment for one host (`qconf -spl` lists them)")
            kw["job_extra_directives"].append(f"-pe {pe} {cores}")
        kw["job_extra_directives"].append("-V")
    elif kind == "pbs":
        if gpus:
            kw["job_extra_directives"].append(f"-l ngpus={gpus}")
    elif kind == "lsf":
        kw["ncpus"] = cores
        if gpus:
            kw["job_extra_directives"].append(f'-gpu "num={gpus}"')
    elif kind == "htcondor":
        kw["job_extra_directives"] = {"request_gpus": str(gpus)} if gpus else {}
        kw["disk"] = s.pop("disk", None) or "1GB"
    for key in ("queue", "account", "project", "walltime", "interface", "python", "log_directory",
                "local_directory"):
        if key in s:
            kw[key] = s.pop(key)
    if "host" in s:
        kw["scheduler_options"]["host"] = s.pop("host")
    return kw


def _configured_walltime(kind: str) -> Any:
    try:
        import_jobqueue(SCHEDULERS[kind].cluster)   # its defaults enter dask's configuration on import
    except ImportError:
        return None
    import dask

    return dask.config.get(f"jobqueue.{kind}.walltime", None)


def slurm_kwargs(settings: Mapping[str, Any], device: str, resources: Mapping[str, float] | None) -> dict:
    """``dask_jobqueue.SLURMCluster`` keyword arguments (:func:`jobqueue_kwargs` for SLURM)."""
    return jobqueue_kwargs("slurm", settings, device, resources)


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


def _tool(kind: str, name: str) -> str:
    import shutil

    path = shutil.which(name)
    if path is None:
        raise ValueError(f"--cluster {kind}:N: `{name}` is not on the PATH; run vsekit where "
                         f"{SCHEDULERS[kind].label} jobs can be submitted (a login node)")
    return path


def _slurm_tool(name: str) -> str:
    return _tool("slurm", name)


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip() != "Exiting."]
    errors = [ln for ln in lines if "error" in ln.lower() or "unable" in ln.lower()]
    return (errors or lines or ["(no message)"])[-1]


CHECK_TIMEOUT_S = 60


def check_submission(job_script: str, n: int, kind: str = "slurm") -> None:
    """Verify the job script without running it (SLURM ``sbatch --test-only``, Grid Engine
    ``qsub -w v``): a queue, account, resource or size the scheduler refuses is one ValueError with
    its own message, before anything is submitted. Schedulers without such a check pass."""
    sched = SCHEDULERS[kind]
    if sched.check is None:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(job_script)
    what = f"`{sched.submit} {' '.join(sched.check)}`"
    try:
        out = subprocess.run([_tool(kind, sched.submit), *sched.check, f.name], capture_output=True,
                             text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"--cluster {kind}:{n}: {what} did not answer in {CHECK_TIMEOUT_S} s") from None
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise ValueError(f"--cluster {kind}:{n}: {sched.label} refuses the job: {_last_error(out.stderr + out.stdout)}")


def job_ids(cluster) -> list[str]:
    """The scheduler's job ids of the cluster's current jobs."""
    return [str(j.job_id) for j in list(getattr(cluster, "workers", {}).values())
            if getattr(j, "job_id", None)]


def cancel_jobs(ids: list[str], kind: str = "slurm") -> None:
    """Cancel exactly these jobs (the run's own: ``scancel``, ``qdel``...), quietly: some may have ended."""
    if ids:
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            subprocess.run([_tool(kind, SCHEDULERS[kind].cancel), *ids], capture_output=True, timeout=30)


def pending_reasons(ids: list[str], kind: str = "slurm") -> str:
    """The scheduler's state of each job of ``ids`` (squeue's reason, qstat's, bjobs's and
    condor_q's state), e.g. ``job 12 PENDING (Resources)``."""
    if not ids:
        return "no job was submitted"
    sched = SCHEDULERS[kind]
    if kind == "slurm":
        cmd = [sched.status, "-h", "-j", ",".join(ids), "-o", "%i %T %r"]
    elif kind in ("sge", "pbs"):
        cmd = [sched.status]
    elif kind == "lsf":
        cmd = [sched.status, "-w", *ids]        # JOBID USER STAT QUEUE FROM_HOST EXEC_HOST JOB_NAME SUBMIT_TIME
    elif kind == "htcondor":
        cmd = [sched.status, "-nobatch", *ids]  # ID OWNER SUBMITTED (date time) RUN_TIME ST PRI SIZE CMD
    else:
        return f"jobs {', '.join(ids)} (ask {sched.status} why)"
    try:
        out = subprocess.run([_tool(kind, cmd[0]), *cmd[1:]], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{sched.status} failed ({exc})"
    if kind == "slurm":
        rows = [ln.split(None, 2) for ln in out.stdout.splitlines() if ln.strip()]
    elif kind in ("lsf", "htcondor"):
        col = 2 if kind == "lsf" else 5
        rows = [[r[0], r[col], sched.status] for r in (ln.split() for ln in out.stdout.splitlines())
                if len(r) > col and r[0] in ids]
    else:   # qstat: job id, priority, name, user, state, ...
        rows = [[r[0], r[4], "qstat"] for r in (ln.split() for ln in out.stdout.splitlines())
                if len(r) > 4 and r[0].split(".")[0] in ids]
    if not rows:
        return f"jobs {', '.join(ids)} are no longer queued" + (f" ({_last_error(out.stderr)})" if out.stderr else "")
    return "; ".join(f"job {r[0]} {r[1] if len(r) > 1 else '?'} ({r[2] if len(r) > 2 else '?'})" for r in rows)


def wait_for_workers(cluster, n: int, timeout: float, kind: str = "slurm") -> None:
    """Wait until one worker has joined; after ``timeout`` s, a ValueError with the jobs' states."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cluster.scheduler_info.get("workers"):
            return
        time.sleep(0.5)
    sched = SCHEDULERS[kind]
    raise ValueError(f"--cluster {kind}:{n}: no {sched.label} job started within {timeout:g} s "
                     f"(start_timeout); {sched.status}: {pending_reasons(job_ids(cluster), kind)}")


@contextlib.contextmanager
def _jobqueue(kind: str, n: int, device: str, resources, settings: Mapping[str, Any]) -> Iterator[Any]:
    sched = SCHEDULERS[kind]
    try:
        cls = import_jobqueue(sched.cluster)
    except ImportError:
        raise ValueError(f"--cluster {kind}:N needs dask-jobqueue: pip install 'vsekit[slurm]'") from None
    s = dict(settings)
    timeout = float(s.get("start_timeout", 600))
    kw = jobqueue_kwargs(kind, s, device, resources)
    _tool(kind, sched.submit)
    _quiet_job_logs()
    try:
        cluster = cls(**kw)
    except (OSError, RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"--cluster {kind}:{n}: cannot start the dask scheduler for {sched.label} ({exc})") from exc
    seen: set[str] = set()
    adaptive = None
    try:
        check_submission(cluster.job_script(), n, kind)
        adaptive = cluster.adapt(minimum_jobs=n, maximum_jobs=n)
        _track_jobs(cluster, seen, timeout)
        wait_for_workers(cluster, n, timeout, kind)
        yield cluster
    finally:
        if adaptive is not None:
            with contextlib.suppress(Exception):
                adaptive.stop()
        seen.update(job_ids(cluster))
        cancel_jobs(sorted(seen), kind)   # by id: this run's jobs only, before dask's slower close
        with contextlib.suppress(Exception):
            cluster.close(timeout=30)


def _slurm(n: int, device: str, resources, settings: Mapping[str, Any]):
    return _jobqueue("slurm", n, device, resources, settings)


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


# --- object storage ---------------------------------------------------------------------------------
#: the executors that serve a store on object storage: their tasks open the URL with the storage
#: options handed to them in memory, over dask's connection (storage/ref.py); pbs, lsf and htcondor
#: run on stand-ins of their schedulers (tests/test_jobqueue_standins.py).
OBJECT_STORAGE_KINDS = ("local", "tcp", "slurm", "sge", "pbs", "lsf", "htcondor")
#: job arrays on object storage: extraction only (their tasks' leases and spec are objects there)
OBJECT_STORAGE_ARRAYS = ("slurm-array", "sge-array")


def report_worker_deaths(client, since: float, say) -> int:
    """``say`` a line for each dask worker that died (left unexpectedly) since ``since`` (a
    ``time.time()``); returns how many."""
    try:
        events = client.get_events("all")
    except Exception:  # an old scheduler without the event log: nothing to say
        return 0
    dead = [e for t, e in events if t >= since and isinstance(e, dict)
            and e.get("action") == "remove-worker" and e.get("expected") is False]
    for e in dead:
        n = len(e.get("processing-tasks") or ())
        say(f"dask worker {e.get('worker', '?')} died during the run"
            + (f" with {n} task(s) in progress; they ran again elsewhere" if n else ""))
    return len(dead)


# --- the entry point --------------------------------------------------------------------------------
@contextlib.contextmanager
def cluster_client(spec: "ClusterSpec | str | None", *, resources: Mapping[str, float] | None = None,
                   device: str = "cpu", timeout: float = 30) -> Iterator[Any]:
    """Yield a ``distributed.Client`` for ``spec`` (a :class:`ClusterSpec`; the text of a library
    caller is parsed here, once), or ``None`` for in-process work.

    ``local:N`` and batch scheduler (``slurm:N``, ``sge:N``...) clusters are started here and shut down afterwards (``resources``
    and, on a CUDA ``device``, ``GPU=1`` are declared by every worker); ``tcp://`` joins an
    existing scheduler.
    """
    spec = parse_cluster(spec)
    if spec is None:
        yield None
        return
    from distributed import Client

    if spec.is_array:
        raise ValueError(f"--cluster {spec}: job arrays run `vsekit extract` only; use "
                         f"{ARRAY_KINDS[spec.kind]}:N here")
    if spec.kind == "tcp":
        try:
            client = Client(spec.address, timeout=timeout)
        except OSError as exc:
            raise ValueError(f"--cluster {spec.address}: cannot reach the dask scheduler ({exc})") from exc
        with client:
            yield client
        return
    starter = (_local(spec.n, device, resources) if spec.kind == "local"
               else _jobqueue(spec.kind, spec.n, device, resources, spec.settings))
    with starter as cluster, Client(cluster, timeout=timeout) as client:
        yield client
