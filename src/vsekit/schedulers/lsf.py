"""LSF: ``bsub`` / ``bkill`` / ``bjobs``; ``--cluster lsf:N`` through dask-jobqueue's ``LSFCluster``.
Tested on a stand-in ``bsub`` that starts the job as LSF would (tests/lsf_local.py,
tests/test_jobqueue_standins.py), not on a real LSF server; no job arrays."""

from __future__ import annotations

from .base import Scheduler, clock


class Lsf(Scheduler):
    name, label, cluster = "lsf", "LSF", "LSFCluster"
    submit, cancel, status = "bsub", "bkill", "bjobs"
    keys = {"project": "Grid Engine / LSF project (-P)"}
    queue_flag = ""
    state_column = 2   # bjobs -w: JOBID USER STAT QUEUE FROM_HOST EXEC_HOST JOB_NAME SUBMIT_TIME

    def seconds(self, walltime: str) -> int | None:
        """bsub -W [HH:]MM[/HOST]: a bare number is minutes; HH:MM:SS or days are no LSF run limit."""
        text = walltime.split("/", 1)[0]
        if "-" in text or text.count(":") > 1:
            return None
        hm = clock(text, 60)
        return hm * 60 if hm is not None and ":" in text else hm

    def requests(self, kw, s, cores, gpus, memory) -> None:
        if s.get("walltime") and self.seconds(str(s["walltime"]).strip()) is None:
            # bsub refuses any other run limit ("Bad RUNLIMIT specification"), and the jobs would never start
            raise ValueError(f"cluster setting walltime {s['walltime']!r}: LSF takes [HH:]MM (bsub -W), e.g. 01:30")
        kw["ncpus"] = cores
        if gpus:
            kw["job_extra_directives"].append(f'-gpu "num={gpus}"')

    def pending_args(self, ids: list[str]) -> list[str]:
        return ["-w", *ids]


SCHEDULER = Lsf()
