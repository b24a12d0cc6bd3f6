"""A single-node Grid Engine on this host (Debian's gridengine 8.1.9: sge_qmaster + sge_execd, one
queue ``all.q`` of 2 slots on ``localhost``), for tests/test_sge.py. Installs nothing: ``.ci/run``
installs the packages with apt (debconf preseeded, daemons kept from starting); this module
configures the cell for tests and starts the daemons, and stops those it started.

The configuration (found on Debian 12, see issue 36): ``/etc/hosts`` lists ``localhost`` first, so
the host is aliased to ``localhost``; jobs run as root (``min_uid``/``min_gid`` 0, set before execd
starts); the queue has no parallel environment, no load threshold (a loaded CI machine would put it
in alarm) and the scheduler runs every second. Jobs start their shell as a plain command interpreter,
never a login shell (``login_shells none``): a login bash reads the profile of the user (root here),
and a development machine's ``pyenv init`` there waited 60 s on a stale ``pyenv rehash`` lock (left
by an interrupted rehash) before every array task started (job arrays use ``-S /bin/bash``).
Needs root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

SGE_ROOT = Path("/var/lib/gridengine")
CELL = "default"
SPOOL = Path("/var/spool/gridengine")
QMASTER_PID = SPOOL / "qmaster" / "qmaster.pid"
EXECD_PID = SPOOL / "execd" / "localhost" / "execd.pid"
CLIENTS = ("qsub", "qconf", "qstat", "qdel", "qmod")
DAEMONS = ("/usr/sbin/sge_qmaster", "/usr/sbin/sge_execd")
QUEUE = "all.q"
SLOTS = 2


def which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in DAEMONS if p.endswith("/" + name) and os.access(p, os.X_OK)), None)


def unavailable() -> str | None:
    """Why a local Grid Engine cannot be started here, or None."""
    missing = [p for p in (*CLIENTS, "sge_qmaster", "sge_execd") if which(p) is None]
    if missing or not (SGE_ROOT / CELL / "common" / "bootstrap").exists():
        return (f"Grid Engine is not installed here (missing {', '.join(missing) or 'its cell'}; apt-get "
                f"install gridengine-master gridengine-exec gridengine-client, as .ci/run does)")
    if os.geteuid() != 0:
        return "the local Grid Engine runs its test jobs as root: run the tests as root"
    try:
        import dask_jobqueue  # noqa: F401
    except ImportError:
        return "dask-jobqueue is not installed (pip install 'vsekit[slurm]')"
    return None


def environment() -> dict[str, str]:
    return dict(os.environ, SGE_ROOT=str(SGE_ROOT), SGE_CELL=CELL)


def qconf(*args: str, env=None, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([which("qconf"), *args], env=env or environment(), capture_output=True, text=True,
                         timeout=60)
    if check and out.returncode != 0:
        raise RuntimeError(f"qconf {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _alive(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError, PermissionError):
        return None
    return pid


def _edited(text: str, values: dict[str, str]) -> str:
    lines = []
    for line in text.splitlines():
        key = line.split(None, 1)[0] if line.strip() else ""
        lines.append(f"{key} {values[key]}" if key in values else line)
    return "\n".join(lines) + "\n"


def _apply(flag: str, text: str, env) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".sge", delete=False) as f:
        f.write(text)
    try:
        qconf(flag, f.name, env=env)
    finally:
        os.unlink(f.name)


def _configure(env) -> None:
    """Settings that qmaster must hold before execd starts (idempotent)."""
    editor = Path(tempfile.mkdtemp()) / "edit.sh"
    editor.write_text("#!/bin/sh\nsed -i -e 's/^min_uid .*/min_uid 0/' -e 's/^min_gid .*/min_gid 0/' "
                      "-e 's/^login_shells .*/login_shells none/' \"$1\"\n")
    editor.chmod(0o755)
    try:
        qconf("-mconf", env=dict(env, EDITOR=str(editor)))
    finally:
        shutil.rmtree(editor.parent)
    _apply("-Msconf", _edited(qconf("-ssconf", env=env).stdout, {
        "schedule_interval": "0:0:1", "flush_submit_sec": "1", "flush_finish_sec": "1"}), env)
    if "localhost" not in qconf("-ss", env=env, check=False).stdout.split():
        qconf("-as", "localhost", env=env)
    if "localhost" not in qconf("-sel", env=env, check=False).stdout.split():
        _apply("-Ae", "hostname localhost\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\n"
                      "xuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\n"
                      "report_variables NONE\n", env)
    queues = qconf("-sql", env=env, check=False).stdout.split()
    template = qconf("-sq", *([QUEUE] if QUEUE in queues else []), env=env).stdout
    _apply("-Mq" if QUEUE in queues else "-Aq", _edited(template, {
        "qname": QUEUE, "hostlist": "localhost", "pe_list": "NONE", "slots": str(SLOTS),
        "load_thresholds": "NONE"}), env)


def _wait(what: str, ready, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        time.sleep(0.3)
    raise RuntimeError(f"the local Grid Engine did not come up: {what} (logs under {SPOOL})")


def _queue_up(env) -> bool:
    out = subprocess.run([which("qstat"), "-f", "-q", QUEUE], env=env, capture_output=True, text=True)
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith(f"{QUEUE}@")]
    # a queue instance with a load value (execd reported) and no state letters (a, u, E, d...)
    return bool(rows) and all(len(r) == 5 and r[3] not in ("-NA-",) for r in rows)


@contextlib.contextmanager
def local_sge(timeout: float = 90) -> Iterator[dict[str, str]]:
    """Configure the cell, start qmaster and execd unless they run; yield the clients' environment.
    On exit the root's jobs are deleted and the daemons this call started are stopped."""
    env = environment()
    alias = SGE_ROOT / CELL / "common" / "host_aliases"
    alias.write_text(f"localhost {socket.gethostname()}\n")
    started = []
    try:
        def qmaster_answers() -> bool:   # (re)start it if none runs: one may be shutting down still
            if _alive(QMASTER_PID) is None:
                subprocess.run([which("sge_qmaster")], env=env, check=True, timeout=60, cwd="/")
                if QMASTER_PID not in started:
                    started.append(QMASTER_PID)
                time.sleep(1)
            return qconf("-sh", env=env, check=False).returncode == 0

        _wait("qmaster answers", qmaster_answers, timeout)
        _configure(env)
        if _alive(EXECD_PID) is None:
            subprocess.run([which("sge_execd")], env=env, check=True, timeout=60, cwd="/")
            started.append(EXECD_PID)
        # an execd that once started with min_uid 1000 leaves the queue in error: clear it
        subprocess.run([which("qmod"), "-c", f"{QUEUE}@localhost"], env=env, capture_output=True)
        _wait(f"queue {QUEUE} on localhost", lambda: _queue_up(env), timeout)
        yield env
    finally:
        delete_all(env)
        for pid_file in reversed(started):
            _stop(pid_file)


def jobs(env) -> list[str]:
    """The ids of the jobs in the queue (pending or running; an array job once)."""
    out = subprocess.run([which("qstat"), "-u", "*"], env=env, capture_output=True, text=True)
    ids = [ln.split()[0] for ln in out.stdout.splitlines()[2:] if ln.split() and ln.split()[0].isdigit()]
    return sorted(set(ids), key=ids.index)


def running(env) -> list[str]:
    """The ids of the running jobs (state ``r``)."""
    out = subprocess.run([which("qstat"), "-u", "*", "-s", "r"], env=env, capture_output=True, text=True)
    return [ln.split()[0] for ln in out.stdout.splitlines()[2:] if ln.split() and ln.split()[0].isdigit()]


def delete_all(env) -> None:
    ids = jobs(env)
    if ids:
        subprocess.run([which("qdel"), "-f", *ids], env=env, capture_output=True)
    deadline = time.time() + 30
    while jobs(env) and time.time() < deadline:
        time.sleep(0.5)


def _stop(pid_file: Path, wait: float = 20) -> None:
    pid = _alive(pid_file)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
