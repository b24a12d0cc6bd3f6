"""PBS: ``qsub`` / ``qdel`` / ``qstat``; ``--cluster pbs:N`` through dask-jobqueue's ``PBSCluster``.
Tested on a stand-in whose ``qsub`` runs the job script at once (tests/test_jobqueue_standins.py),
not on a real PBS server; no job arrays."""

from __future__ import annotations

from .base import Scheduler


class Pbs(Scheduler):
    name, label, cluster = "pbs", "PBS", "PBSCluster"
    submit, cancel, status = "qsub", "qdel", "qstat"
    keys = {"account": "SLURM / PBS account (-A)"}

    def requests(self, kw, s, cores, gpus, memory) -> None:
        if gpus:
            kw["job_extra_directives"].append(f"-l ngpus={gpus}")


SCHEDULER = Pbs()
