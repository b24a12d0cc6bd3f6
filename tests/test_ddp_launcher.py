"""What `vsekit train --nproc-per-node N` says when a run is refused or fails: once, in one line.

- A refusal that can be decided before the ranks start (here: ``--resume`` of a folder without a
  checkpoint) is decided by the launcher, once: one Error line, no rank started (no ranks' log).
- ``--max-restarts`` without ``--nproc-per-node`` is refused in one line.
- A failure in the ranks (a damaged checkpoint met by every rank on ``--resume``; a rank killed before
  the first checkpoint) is one Error line naming the rank, with torch's and gloo's own logging kept
  in the run's ``ranks.log``, out of the terminal; resume advice only when a checkpoint exists.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from test_ddp_cli import base, cli, store_path, single  # noqa: F401 (fixtures)
from vsekit.cli import main

# what torch, gloo and the elastic agent print on their own, which the terminal must not show
NOISE = ("Traceback", "exitcode", "frame #", "pair.cc", "reducer.cpp", "Root Cause", "[W", "torch/distributed")


def error_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("Error")]


def test_max_restarts_needs_the_launcher(store_path, tmp_path):  # noqa: F811
    res = CliRunner().invoke(main, base(store_path, tmp_path / "r", "--max-restarts", "2"))
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "Error: --max-restarts restarts the ranks that --nproc-per-node starts; give --nproc-per-node N, "
        "or drop --max-restarts"]
    assert not (tmp_path / "r").exists()


def test_a_refusal_known_before_the_ranks_start_is_said_once_by_the_launcher(store_path, tmp_path):  # noqa: F811
    out = tmp_path / "empty"
    out.mkdir()
    res = cli(base(store_path, out, "--nproc-per-node", "2", "--resume"))
    assert res.returncode == 1
    text = res.stdout + res.stderr
    assert error_lines(text) == [f"Error: --resume: {out} has no checkpoint_last.pt to resume from"], text
    assert not any(n in text for n in NOISE), text
    assert list(out.iterdir()) == []          # no rank started: not even the ranks' log


@pytest.mark.slow
def test_a_failure_in_the_ranks_is_one_error_line_naming_a_rank(store_path, single, tmp_path):  # noqa: F811
    """Every rank meets the damaged checkpoint (only the ranks load it): the launcher says it once."""
    out = tmp_path / "damaged"
    shutil.copytree(single, out)
    data = (out / "checkpoint_last.pt").read_bytes()
    (out / "checkpoint_last.pt").write_bytes(data[: len(data) // 2])
    res = cli(base(store_path, out, "--nproc-per-node", "2", "--resume"))
    assert res.returncode == 1
    text = res.stdout + res.stderr
    errors = error_lines(text)
    assert len(errors) == 1, text
    assert errors[0].startswith(("Error: rank 0: ", "Error: rank 1: ")), errors
    assert "checkpoint_last.pt" in errors[0] and "damaged or truncated" in errors[0], errors
    assert not any(n in text for n in NOISE), text
    log = (out / "ranks.log").read_text()
    assert log.count("damaged or truncated") == 2 and "exitcode" in log   # each rank's line and the agent's


@pytest.mark.slow
def test_a_rank_dead_before_the_first_checkpoint_gets_no_resume_advice(store_path, tmp_path):  # noqa: F811
    from test_ddp_faults import ranks_of, start, wait_for

    out = tmp_path / "early"
    proc = start(base(store_path, out, "--nproc-per-node", "2", "--collective-timeout", "30", epochs=20))
    assert wait_for(lambda: len(ranks_of(proc.pid)) == 2)
    os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)     # still importing torch: long before any checkpoint
    t0 = time.monotonic()
    output = proc.communicate(timeout=120)[0]
    assert time.monotonic() - t0 < 90
    assert proc.returncode == 1, output
    assert not (out / "checkpoint_last.pt").exists()
    errors = error_lines(output)
    assert len(errors) == 1 and errors[0].startswith("Error: rank 1 died (signal 9)"), output
    assert "no checkpoint was saved yet" in errors[0] and "--resume" not in errors[0].replace("without --resume", "")
    assert not any(n in output for n in NOISE), output
    assert "exitcode: -9" in (out / "ranks.log").read_text()
