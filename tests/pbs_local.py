"""A stand-in PBS for tests: ``qsub``, ``qdel`` and ``qstat`` on the PATH (tests/batch_local.py).

No PBS server can be installed here, so ``--cluster pbs:N`` is driven through dask-jobqueue's own
``PBSCluster`` against these: ``qsub SCRIPT`` copies the job script into the folder, starts it at
once in its own session (as a job on a node: a fresh, minimal environment, no variable of the
submitting shell, as PBS without ``-V``), and prints a job id as PBS does (``12.pbs-local``);
``qdel ID...`` ends each job's whole process group; ``qstat`` lists the live jobs. What this tests
for real: vsekit's PBS settings, the job script dask-jobqueue writes from them (bash runs it: the
``#PBS`` lines are comments to it), the submission and the cancellation of exactly the run's jobs;
not PBS's own scheduling.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import batch_local
from batch_local import end_all, live_jobs

__all__ = ["install", "live_jobs", "end_all"]   # the tests' set-up, check and clean-up
DIR = "PBS_LOCAL_DIR"


def qsub(args: list[str]) -> int:
    """qsub SCRIPT: start the job now, in its own session, with a node's minimal environment."""
    jobs = batch_local.jobs_dir(DIR)
    job = str(batch_local.new_id(jobs))
    script = jobs / f"{job}.sh"
    shutil.copyfile(args[-1], script)
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "PBS_JOBID": f"{job}.pbs-local"}
    batch_local.start(jobs, job, ["bash", str(script)], env, jobs / f"{job}.out", jobs / f"{job}.err",
                      cwd=Path.cwd())
    print(f"{job}.pbs-local")
    return 0


def qdel(args: list[str]) -> int:
    """qdel ID...: end each job's process group (an ended job is no error, as PBS's qdel -W force)."""
    jobs = batch_local.jobs_dir(DIR)
    for job in args:
        batch_local.cancel(jobs, job.split(".")[0])
    return 0


def qstat(args: list[str]) -> int:
    """qstat: one line per live job (id, priority, name, user, state), as vsekit reads PBS's."""
    for job in batch_local.alive(batch_local.jobs_dir(DIR)):
        print(f"{job}.pbs-local 0 dask-worker {os.environ.get('USER', 'user')} R")
    return 0


COMMANDS = {"qsub": qsub, "qdel": qdel, "qstat": qstat}


def install(folder: Path) -> dict[str, str]:
    """Write the three commands into ``folder/bin``; returns the environment that puts them first on
    the PATH (the jobs' files go to ``folder/jobs``)."""
    return batch_local.install(folder, __file__, list(COMMANDS), DIR)


if __name__ == "__main__":
    batch_local.main(COMMANDS)
