"""HTCondor: ``condor_submit`` / ``condor_rm`` / ``condor_q``; ``--cluster htcondor:N`` through
dask-jobqueue's ``HTCondorCluster``. Its jobs take no walltime (workers retire after ``lifetime``
seconds). Tested on a stand-in ``condor_submit`` (tests/htcondor_local.py,
tests/test_jobqueue_standins.py), not on a real HTCondor pool; no job arrays."""

from __future__ import annotations

from .base import Scheduler


class HTCondor(Scheduler):
    name, label, cluster = "htcondor", "HTCondor", "HTCondorCluster"
    submit, cancel, status = "condor_submit", "condor_rm", "condor_q"
    keys = {"disk": "HTCondor disk per job (default 1GB)"}
    walltime = False
    queue_flag = ""

    def requests(self, kw, s, cores, gpus, memory) -> None:
        kw["job_extra_directives"] = {"request_gpus": str(gpus)} if gpus else {}
        kw["disk"] = s.pop("disk", None) or "1GB"

    def pending_args(self, ids: list[str]) -> list[str]:
        return ["-nobatch", *ids]   # ID OWNER SUBMITTED (date time) RUN_TIME ST PRI SIZE CMD

    def pending_rows(self, out: str, ids: list[str]) -> list[list[str]]:
        return [[r[0], r[5], self.status] for r in (ln.split() for ln in out.splitlines()) if len(r) > 5 and r[0] in ids]


SCHEDULER = HTCondor()
