"""Data-parallel runs that are preempted or lose a rank (slow: each starts real process groups).

- SIGTERM to ``vsekit train --nproc-per-node 2`` mid-epoch: every rank stops at the next step
  boundary, rank 0 saves the position, exit 143; ``--resume`` on ONE rank (another rank count) ends
  with the weights of an uninterrupted one-process run (float32, to tolerance).
- A rank killed (SIGKILL) without restarts: the run exits 1 with an Error line naming the dead rank,
  within a bounded time (never hangs); the same for ranks joined from the environment (as under
  ``srun``), where the survivor names the dead rank from the group's heartbeats.
- With ``--max-restarts 1`` the group restarts from the last checkpoint and ends with the
  uninterrupted weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from test_ddp_cli import assert_same_weights, base, ok, store_path, single  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def start(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "vsekit.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def wait_for(pred, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def ranks_of(pid: int) -> dict[int, int]:
    """{rank: pid} of the workers the launcher ``pid`` started."""
    import psutil

    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.Error, OSError):
            continue
        if "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            found[int(env["RANK"])] = child.pid
    return found


def mid_epoch(out):
    path = out / "checkpoint_last.pt"
    if not path.is_file():
        return False
    try:
        return "position" in torch.load(path, weights_only=True)
    except Exception:
        return False


def test_sigterm_stops_saves_and_resumes_on_another_rank_count(store_path, single, tmp_path):  # noqa: F811
    out = tmp_path / "term"
    proc = start(base(store_path, out, "--nproc-per-node", "2", "--checkpoint-every", "3"))
    assert wait_for(lambda: mid_epoch(out)), proc.communicate()[0]
    os.kill(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, output
    assert "interrupted in epoch" in output and "Traceback" not in output.split("interrupted in epoch")[0][-2000:]
    ck = torch.load(out / "checkpoint_last.pt", weights_only=True)
    assert ck["state"]["epoch"] < 3 or "position" in ck
    assert not list(out.glob("*.tmp"))
    ok(base(store_path, out, "--checkpoint-every", "3", "--resume"))       # one process now
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt")


def test_killed_rank_without_restarts_is_named(store_path, tmp_path):  # noqa: F811
    out = tmp_path / "dead"
    proc = start(base(store_path, out, "--nproc-per-node", "2", "--collective-timeout", "30", epochs=20))
    assert wait_for(lambda: len(ranks_of(proc.pid)) == 2 and (out / "metrics.jsonl").is_file())
    t0 = time.monotonic()
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)
    output = proc.communicate(timeout=120)[0]
    assert time.monotonic() - t0 < 90
    assert proc.returncode == 1, output
    assert "Error: rank 1 died (signal 9)" in output, output[-3000:]


def test_killed_rank_of_an_environment_launched_group_is_named(store_path, tmp_path):  # noqa: F811
    """Ranks joined from the environment (what srun or torchrun set): no agent; the survivor's
    collective fails, and it names the dead rank from the heartbeats, with one Error line."""
    from vsekit.train.distributed import free_port

    out = tmp_path / "env"
    port = str(free_port())
    procs = [start(base(store_path, out, "--collective-timeout", "30", epochs=20),
                   {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port}) for r in range(2)]
    assert wait_for(lambda: (out / "metrics.jsonl").is_file())
    time.sleep(1.0)
    t0 = time.monotonic()
    procs[1].kill()
    output = procs[0].communicate(timeout=120)[0]
    procs[1].communicate()
    assert time.monotonic() - t0 < 90
    assert procs[0].returncode == 1, output
    errors = [x for x in output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and "rank 1 died or stopped answering" in errors[0], output[-3000:]


def test_restart_after_a_dead_rank_continues_from_the_checkpoint(store_path, single, tmp_path):  # noqa: F811
    out = tmp_path / "restart"
    proc = start(base(store_path, out, "--nproc-per-node", "2", "--max-restarts", "1", "--checkpoint-every", "3",
                      "--collective-timeout", "30"))
    assert wait_for(lambda: mid_epoch(out) and len(ranks_of(proc.pid)) == 2)
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)
    output = proc.communicate(timeout=300)[0]
    (tmp_path / "output.txt").write_text(output)
    assert proc.returncode == 0, output[-3000:]
    assert "resuming" in output
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt")


def test_ctrl_c_to_the_launcher_and_its_ranks_saves_and_exits_130(store_path, single, tmp_path):  # noqa: F811
    """A terminal's Ctrl-C reaches the launcher and every rank (one process group), and the launcher
    forwards it: the ranks still stop at a step boundary with the position saved, exit 130."""
    out = tmp_path / "ctrlc"
    proc = start(base(store_path, out, "--nproc-per-node", "2", "--checkpoint-every", "3"))
    assert wait_for(lambda: mid_epoch(out))
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted in epoch" in output
    assert not list(out.glob("*.tmp"))
    ok(base(store_path, out, "--checkpoint-every", "3", "--resume"))
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt")
