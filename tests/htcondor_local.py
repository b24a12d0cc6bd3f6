"""A stand-in HTCondor for tests: ``condor_submit``, ``condor_rm`` and ``condor_q`` on the PATH
(tests/batch_local.py).

No HTCondor pool can be installed here, so ``--cluster htcondor:N`` is driven through dask-jobqueue's
own ``HTCondorCluster`` against these. ``condor_submit FILE`` reads the submit description as
HTCondor does (``key = value`` commands, case-insensitive; ``#`` comments; ``$(NAME)`` macros of the
description and ``$(ClusterId)`` / ``$(ProcId)``; ``$F(NAME)`` the same without its quotes;
``Arguments`` in the new quoting syntax; ``Queue``), copies it into the folder and starts one job at
once in its own session: ``Executable`` with ``Arguments`` (its ``argv[0]`` is ``condor_exec.exe``,
as HTCondor runs it), in a fresh scratch folder, with the environment HTCondor gives a job: none of
the submitter's variables (``getenv`` is false by default), only ``Environment``'s and HTCondor's own
(``_CONDOR_SCRATCH_DIR``, ``_CONDOR_SLOT``, ``_CONDOR_JOB_IWD``, ``TMPDIR``, ``BATCH_SYSTEM``,
``OMP_NUM_THREADS`` from the requested cpus); no ``PATH`` nor ``HOME``. ``Output`` / ``Error``
(relative to the submit folder, else discarded) get its output as it runs, ``Log`` the job's events
(submitted, executing, aborted). It prints ``1 job(s) submitted to cluster N.``; the job is ``N.0``.
``condor_rm ID...`` ends each job's whole process group (an ended one: "Couldn't find/remove",
status 1); ``condor_q`` lists the live jobs (``R``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import batch_local

DIR = "CONDOR_LOCAL_DIR"


def read_description(text: str) -> tuple[dict[str, str], int]:
    """The commands of a submit description (keys lower-cased) and its Queue count."""
    commands: dict[str, str] = {}
    queue = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word = line.split(None, 1)
        if word[0].lower() == "queue":
            queue = int(word[1]) if len(word) > 1 else 1
            continue
        key, eq, value = line.partition("=")
        if not eq:
            raise ValueError(f"Illegal line in submit file: {line}")
        commands[key.strip().lower()] = value.strip()
    return commands, queue


def expand(text: str, commands: dict[str, str], ids: dict[str, str], depth: int = 0) -> str:
    """``$(NAME)`` → the command NAME (or ClusterId, ProcId), ``$F(NAME)`` → the same, unquoted."""
    if depth > 20:
        raise ValueError(f"macro recursion in {text!r}")

    def value(match: re.Match) -> str:
        name = match.group(2).lower()
        if name in ids:
            out = ids[name]
        elif name in commands:
            out = expand(commands[name], commands, ids, depth + 1)
        else:
            raise ValueError(f"Macro $({match.group(2)}) is undefined")
        return out.strip('"') if match.group(1) else out

    return re.sub(r"\$(F)?\(([A-Za-z0-9_.+]+)\)", value, text)


def split_arguments(text: str) -> list[str]:
    """``Arguments`` in HTCondor's new syntax: in double quotes; words split by spaces; a word in
    single quotes keeps its spaces; ``''`` is a single quote in it, ``""`` a double quote."""
    text = text.strip()
    if not (text.startswith('"') and text.endswith('"')):
        return text.split()   # the old syntax: plain words
    text = text[1:-1].replace('""', '"')
    words, word, quoted, i, started = [], "", False, 0, False
    while i < len(text):
        c = text[i]
        if c == "'":
            if quoted and text[i + 1:i + 2] == "'":
                word, i = word + "'", i + 2
                continue
            quoted, started = not quoted, True
        elif c.isspace() and not quoted:
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + c, True
        i += 1
    if quoted:
        raise ValueError("unbalanced single quote in Arguments")
    if started:
        words.append(word)
    return words


def _event(log: Path | None, code: str, job: str, what: str) -> None:
    if log is not None:
        cluster, proc = job.split(".")
        stamp = time.strftime("%m/%d %H:%M:%S")
        with log.open("a") as f:
            f.write(f"{code} ({int(cluster):03d}.{int(proc):03d}.000) {stamp} {what}\n...\n")


def condor_submit(args: list[str]) -> int:
    """condor_submit FILE: start the job it describes now; prints its cluster as HTCondor does."""
    jobs = batch_local.jobs_dir(DIR)
    try:
        commands, queue = read_description(Path(args[-1]).read_text())
        if queue != 1:
            raise ValueError(f"the stand-in runs one job per description (Queue {queue})")
        cluster = str(batch_local.new_id(jobs))
        job = f"{cluster}.0"
        ids = {"clusterid": cluster, "cluster": cluster, "procid": "0", "process": "0"}
        get = {k: expand(v, commands, ids) for k, v in commands.items()}
        executable = get["executable"]
        arguments = split_arguments(get.get("arguments", '""'))
    except (ValueError, KeyError, IndexError, OSError) as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 1
    shutil.copyfile(args[-1], jobs / f"{cluster}.sub")
    iwd = Path(get.get("initialdir") or os.getcwd())
    scratch = jobs / f"{job}.scratch"
    scratch.mkdir()
    cpus = get.get("request_cpus") or get.get("requestcpus") or "1"
    cpus = cpus if cpus.isdigit() else get.get(cpus.lower(), "1")   # an attribute: MY.DaskWorkerCores
    env = {"_CONDOR_SCRATCH_DIR": str(scratch), "_CONDOR_SLOT": "slot1", "_CONDOR_JOB_IWD": str(iwd),
           "TMPDIR": str(scratch), "TMP": str(scratch), "TEMP": str(scratch), "BATCH_SYSTEM": "HTCondor",
           "OMP_NUM_THREADS": cpus if cpus.isdigit() else "1"}
    for pair in split_arguments(get["environment"]) if get.get("environment") else []:
        key, _, value = pair.partition("=")
        env[key] = value
    if get.get("getenv", "false").lower() == "true":
        env = {**os.environ, **env}

    def path(key: str) -> Path | None:
        return iwd / get[key] if get.get(key) else None

    log = path("log")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    _event(log, "000", job, "Job submitted from host: <127.0.0.1:0>")
    (jobs / f"{job}.job").write_text(json.dumps({"log": str(log) if log else None, "cmd": Path(executable).name,
                                                 "submitted": time.strftime("%m/%d %H:%M")}))
    batch_local.start(jobs, job, ["condor_exec.exe", *arguments], env, path("output"), path("error"),
                      cwd=scratch, executable=executable)
    _event(log, "001", job, "Job executing on host: <127.0.0.1:0>")
    print("Submitting job(s).")
    print(f"1 job(s) submitted to cluster {cluster}.")
    return 0


def condor_rm(args: list[str]) -> int:
    """condor_rm ID...: end each job (N.0, or its cluster N) and log its abort."""
    jobs, status = batch_local.jobs_dir(DIR), 0
    for arg in args:
        job = arg if "." in arg else f"{arg}.0"
        if batch_local.cancel(jobs, job):
            log = json.loads((jobs / f"{job}.job").read_text())["log"]
            _event(Path(log) if log else None, "009", job, "Job was aborted.")
            print(f"Job {job} marked for removal")
        else:
            print(f"Couldn't find/remove all jobs matching constraint (ClusterId == {job.split('.')[0]})",
                  file=sys.stderr)
            status = 1
    return status


def condor_q(args: list[str]) -> int:
    """condor_q [-nobatch] [ID...]: the live jobs (all, or those named: N.0 or N), state R."""
    jobs = batch_local.jobs_dir(DIR)
    named = [a if "." in a else f"{a}.0" for a in args if not a.startswith("-")]
    print(" ID      OWNER            SUBMITTED     RUN_TIME ST PRI SIZE CMD")
    live = [j for j in batch_local.alive(jobs) if not named or j in named]
    for job in live:
        info = json.loads((jobs / f"{job}.job").read_text())
        print(f"{job:>7}  {os.environ.get('USER', 'user'):<16} {info['submitted']}   0+00:00:00 R  0   0.0  "
              f"{info['cmd']}")
    print(f"\n{len(live)} jobs; 0 idle, {len(live)} running, 0 held")
    return 0


COMMANDS = {"condor_submit": condor_submit, "condor_rm": condor_rm, "condor_q": condor_q}


def install(folder: Path) -> dict[str, str]:
    """Write the three commands into ``folder/bin``; returns the environment that puts them first on
    the PATH (the jobs' descriptions and scratch folders go to ``folder/jobs``)."""
    return batch_local.install(folder, __file__, list(COMMANDS), DIR)


if __name__ == "__main__":
    batch_local.main(COMMANDS)
