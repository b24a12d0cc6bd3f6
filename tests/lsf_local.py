"""A stand-in LSF for tests: ``bsub``, ``bkill`` and ``bjobs`` on the PATH (tests/batch_local.py).

No LSF server can be installed here, so ``--cluster lsf:N`` is driven through dask-jobqueue's own
``LSFCluster`` against these. ``bsub < SCRIPT`` (how dask-jobqueue submits by default, its
``use-stdin``) reads the job script from its standard input, as LSF does: the ``#BSUB`` lines at its
top are its options, checked as bsub checks them (``-W [HH:]MM``, ``-M`` a number with an optional
unit, ``-n`` a count: anything else is refused, bsub's status 255), spools it into the folder and
starts it at once in its own session, in the submission folder, with what LSF gives a job: the
submitting environment (bsub copies it by default) plus ``LSB_JOBID``, ``LSB_JOBNAME``,
``LSB_QUEUE`` and ``LSB_DJOB_NUMPROC``. Its output goes to ``-o`` (appended; ``%J`` is the job id),
its errors to ``-e`` (without ``-e``: with the output); without ``-o`` LSF mails the output, the
stand-in keeps it in ``jobs/ID.out``. It prints ``Job <ID> is submitted to queue <QUEUE>.``.
``bkill ID...`` ends each job's whole process group; ``bjobs`` lists the live jobs (``RUN``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import batch_local

DIR = "LSF_LOCAL_DIR"
#: bsub's options that take a value (those vsekit's job scripts use, and a few more)
VALUED = {"-J", "-o", "-oo", "-e", "-eo", "-q", "-P", "-n", "-M", "-W", "-R", "-gpu", "-G", "-cwd"}
CHECKS = {"-W": (r"(\d+:)?\d+", "Bad RUNLIMIT specification"),          # [hour:]minute
          "-M": (r"\d+(\.\d+)?([KMGTPEZ]B?)?", "Bad argument for option -M"),
          "-n": (r"\d+(,\d+)?", "Bad argument for option -n")}


def directives(script: str) -> dict[str, str]:
    """The ``#BSUB`` options at the top of the script (before its first command), as bsub reads them."""
    opts: dict[str, str] = {}
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        text = line.strip()
        if not text:
            continue
        if not text.startswith("#"):
            break
        if not text.startswith("#BSUB"):
            continue
        words = shlex.split(text[len("#BSUB"):])
        while words:
            opt = words.pop(0)
            if opt in VALUED:
                if not words:
                    raise ValueError(f"{opt}: option requires an argument")
                opts[opt] = words.pop(0)
            else:
                opts[opt] = ""
    return opts


def bsub(args: list[str]) -> int:
    """bsub < SCRIPT: spool the script and start it now; prints the job id as LSF does."""
    if args:
        print("bsub (stand-in): only `bsub < SCRIPT` is served here (dask-jobqueue's use-stdin)", file=sys.stderr)
        return 255
    script = sys.stdin.read()
    try:
        opts = directives(script)
    except ValueError as exc:
        print(f"{exc}. Job not submitted.", file=sys.stderr)
        return 255
    for opt, (pattern, message) in CHECKS.items():
        if opt in opts and not re.fullmatch(pattern, opts[opt], flags=re.IGNORECASE):
            print(f"{opts[opt]}: {message}. Job not submitted.", file=sys.stderr)
            return 255
    jobs = batch_local.jobs_dir(DIR)
    job = str(batch_local.new_id(jobs))
    spool = jobs / f"{job}.sh"
    spool.write_text(script)
    spool.chmod(0o755)
    queue, name = opts.get("-q", "normal"), opts.get("-J", "")
    (jobs / f"{job}.job").write_text(json.dumps({"queue": queue, "name": name,
                                                 "submitted": time.strftime("%b %d %H:%M")}))

    def path(opt: str) -> Path | None:
        value = opts.get(opt) or opts.get(opt + "o")
        return Path(value.replace("%J", job).replace("%I", "0")) if value else None

    out = path("-o") or jobs / f"{job}.out"
    err = path("-e") or out
    env = {k: v for k, v in os.environ.items() if k != DIR}
    env.update({"LSB_JOBID": job, "LSB_JOBNAME": name or spool.name, "LSB_QUEUE": queue,
                "LSB_DJOB_NUMPROC": opts.get("-n", "1").split(",")[0]})
    batch_local.start(jobs, job, [str(spool)], env, out, err, cwd=Path(opts.get("-cwd") or os.getcwd()))
    print(f"Job <{job}> is submitted to queue <{queue}>.")
    return 0


def bkill(args: list[str]) -> int:
    """bkill ID...: end each job's process group."""
    jobs, status = batch_local.jobs_dir(DIR), 0
    for job in args:
        if batch_local.cancel(jobs, job):
            print(f"Job <{job}> is being terminated")
        else:
            print(f"Job <{job}>: Job has already finished", file=sys.stderr)
            status = 255
    return status


def bjobs(args: list[str]) -> int:
    """bjobs [ID...]: the live jobs (all, or those named), state RUN."""
    jobs = batch_local.jobs_dir(DIR)
    named = [a for a in args if not a.startswith("-")]   # -w (wide): the same columns here
    live = [j for j in batch_local.alive(jobs) if not named or j in named]
    if not live:
        print("No unfinished job found", file=sys.stderr)
        return 0
    print("JOBID   USER    STAT  QUEUE      FROM_HOST   EXEC_HOST   JOB_NAME   SUBMIT_TIME")
    for job in live:
        info = json.loads((jobs / f"{job}.job").read_text())
        user = os.environ.get("USER", "user")
        print(f"{job:<7} {user:<7} RUN   {info['queue']:<10} localhost   localhost   {info['name'] or '-':<10} "
              f"{info['submitted']}")
    return 0


COMMANDS = {"bsub": bsub, "bkill": bkill, "bjobs": bjobs}


def install(folder: Path) -> dict[str, str]:
    """Write the three commands into ``folder/bin``; returns the environment that puts them first on
    the PATH (the jobs' spooled scripts go to ``folder/jobs``)."""
    return batch_local.install(folder, __file__, list(COMMANDS), DIR)


if __name__ == "__main__":
    batch_local.main(COMMANDS)
