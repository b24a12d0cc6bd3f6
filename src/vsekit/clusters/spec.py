"""``--cluster``, parsed once at the edge (the CLI, ``vsekit run``, a library call) into a
:class:`ClusterSpec` with its batch scheduler's settings, and passed on to every stage."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..devices import is_cuda, worker_device
from ..schedulers import SCHEDULERS
from ..schedulers.base import job_cores

SPEC_HELP = ("local:N (N worker processes here) | slurm:N (N SLURM jobs) | slurm-array:N (an sbatch "
             "job array of N tasks, no driver) | sge:N (N Grid Engine jobs; pbs:N, lsf:N, htcondor:N "
             "likewise, tested on stand-ins only) | sge-array:N (a qsub -t job array) | tcp://HOST:PORT (a running dask scheduler)")
ENV_SETTINGS = "VSEKIT_CLUSTER_CONFIG"
# the keys of a `cluster:` section (pipelines.yaml) and of `settings`, with what they mean
CLUSTER_KEYS = {
    "queue": "SLURM partition (-p), Grid Engine / PBS / LSF queue (-q)",
    **{k: what for s in SCHEDULERS.values() for k, what in s.keys.items()},   # each scheduler's own
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
}
#: driverless job arrays: ``NAME-array`` for each scheduler that runs them
ARRAY_KINDS = {f"{k}-array": k for k, s in SCHEDULERS.items() if s.array_flags is not None}


@dataclass(frozen=True)
class ClusterSpec:
    """``--cluster``, parsed: ``kind``: local | tcp | a scheduler's name (``slurm``, ``sge``...) |
    an array (``slurm-array``, ``sge-array``); ``n``: workers, jobs or array tasks; ``address``: the
    scheduler of ``tcp://``; ``settings``: the batch scheduler's settings (:data:`CLUSTER_KEYS`).
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
        """Whether the workers are jobs of a batch scheduler (:mod:`vsekit.schedulers`)."""
        return self.kind in SCHEDULERS

    @property
    def scheduler(self):
        """The batch scheduler of the jobs or the array (:mod:`vsekit.schedulers`); None otherwise."""
        return SCHEDULERS.get(ARRAY_KINDS.get(self.kind, self.kind))

    @property
    def resolves_on_workers(self) -> bool:
        """Whether ``--device`` is resolved on the cluster's nodes, not here: a batch scheduler's jobs
        (a login node may have no GPU) and a running scheduler's workers (``tcp://``, started elsewhere)."""
        return self.is_jobqueue or self.is_array or self.kind == "tcp"

    def gpus_per_job(self, device: str) -> int:
        """GPUs per job: ``gpus`` (default 1) with ``cuda``/``cuda:N``, ``gpus`` with ``auto``, 0 on CPU."""
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
        """The ``device`` a task gets; it resolves it on its worker. Pinned GPU workers (local, batch
        jobs) see their one GPU as ``cuda``; a job without GPUs runs on its CPUs whatever the node has."""
        if self.kind == "local":
            return worker_device(device)
        if self.is_jobqueue:
            if not self.uses_gpu(device):
                return "cpu"
            return "cuda" if is_cuda(device) else "auto"
        return device

    def task_cpus(self, device: str = "cpu", cpus: int | None = None) -> int | None:
        """The CPU cores of one task (a dask worker is single-threaded: its decoding threads share
        them): a job's ``cores`` shared by its workers; ``local:N``: this machine's cores shared by
        the N workers; ``tcp://``: None, the cores of each worker, seen there. The task sizes its
        decoding from them (:func:`vsekit.extract.site.resolve`)."""
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


def parse_cluster(spec: "str | ClusterSpec | None", settings: Mapping[str, Any] | None = None) -> ClusterSpec | None:
    """``None``/``""`` → None; ``local:N``, ``slurm:N``, ``slurm-array:N``, ``tcp://HOST:PORT``... → a
    :class:`ClusterSpec` (a ClusterSpec is returned as it is). Batch settings: ``settings`` (``vsekit
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
