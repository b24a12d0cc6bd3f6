"""A throw-away single-node SLURM on 127.0.0.1 (munged + slurmctld + slurmd, minimal slurm.conf in a
folder of its own), for tests/test_slurm.py and bench/cluster.py. Needs Debian's ``slurm-wlm`` and
``munge`` packages and root (slurmd starts jobs as their user)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "scontrol")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin")

SLURM_CONF = """\
ClusterName=vsekittest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
NodeName=vsekitnode NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=16000 State=UNKNOWN
PartitionName=vsekit Nodes=vsekitnode Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def which(name: str) -> str | None:
    return shutil.which(name) or next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def unavailable() -> str | None:
    """Why a local SLURM cannot be started here, or None."""
    missing = [p for p in PROGRAMS if which(p) is None]
    if missing:
        return (f"SLURM is not installed here (missing {', '.join(missing)}; "
                f"apt-get install slurm-wlm munge, as .ci/run does)")
    if os.geteuid() != 0:
        return "the local SLURM's slurmd must run as root (it starts jobs as their user)"
    try:
        import dask_jobqueue  # noqa: F401
    except ImportError:
        return "dask-jobqueue is not installed (pip install 'vsekit[slurm]')"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jobs(env) -> list[str]:
    out = subprocess.run([which("squeue"), "-h", "-o", "%i"], env=env, capture_output=True, text=True)
    return out.stdout.split()


def time_out(env, *job: str) -> None:
    """Bring the time limit of the running jobs ``job`` forward to one moment a few seconds from now
    (``scontrol update EndTime``): slurmctld then ends them DUE TO TIME LIMIT, SIGTERM first, at its
    next limit check (it checks every 30 s), as at the end of their walltime, whose resolution is a
    minute (``man sbatch``, ``--time``). A test whose job must go past its time limit waits 5-35 s for
    it, not 60-90. A job that has ended meanwhile (at that walltime) is left as it is."""
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 5))
    for j in job:
        out = subprocess.run([which("scontrol"), "update", f"JobId={j}", f"EndTime={end}"], env=env,
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0 and j in jobs(env):
            raise RuntimeError(f"scontrol update JobId={j} EndTime={end}: {out.stderr.strip() or out.stdout.strip()}")


@contextlib.contextmanager
def local_slurm(d: Path, cpus: int = 4, timeout: float = 60) -> Iterator[dict[str, str]]:
    """Start the daemons with their files in ``d``; yield the environment (SLURM_CONF) of clients."""
    d = Path(d)
    (d / "state").mkdir(parents=True, exist_ok=True)
    (d / "spool").mkdir(exist_ok=True)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = d / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], dir=d, cpus=cpus,
                                      ctl_port=_free_port(), d_port=_free_port()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    log = open(d / "daemons.log", "w")

    def start(*args):
        subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=60)

    try:
        start(which("munged"), f"--key-file={key}", f"--socket={d}/munge.sock", f"--pid-file={d}/munged.pid",
              f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed", "--force")
        start(which("slurmctld"), "-f", str(conf))
        start(which("slurmd"), "-f", str(conf), "-N", "vsekitnode")
        deadline, state = time.time() + timeout, ""
        while time.time() < deadline:
            out = subprocess.run([which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            state = out.stdout.strip() + out.stderr.strip()
            if out.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the local SLURM did not come up (sinfo: {state!r}); logs in {d}")
        yield env
    finally:
        subprocess.run([which("scancel"), "--user", "root"], env=env, capture_output=True)
        for name in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            _stop(d / name)
        log.close()


def _stop(pid_file: Path, wait: float = 15) -> None:
    """SIGTERM the daemon of ``pid_file`` and wait until it has exited (it saves its state first)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return
    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
