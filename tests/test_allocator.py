"""vsekit.allocator: freed numeric temporaries are reused instead of being faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WORKLOAD = """
import resource, torch
from vsekit.allocator import tune_allocator
ok = tune_allocator()
assert tune_allocator() is ok            # idempotent
def run():
    x = torch.ones(64, 1 << 14)
    for i in range(30):
        y = torch.cat([x] * (1 + i % 5))  # 4-20 MB temporaries of varying size
        z = (y * 2).sum(0)
        del y, z
run(); run()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    run()
print(ok, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(tuning: str) -> tuple[bool, int]:
    env = {**os.environ, "VSEKIT_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", WORKLOAD], env=env, capture_output=True, text=True, check=True)
    ok, n = out.stdout.split()
    return ok == "True", int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_allocator_reuses_freed_blocks():
    tuned, n_tuned = faults("1")
    off, n_off = faults("0")
    assert off is False                     # VSEKIT_MALLOC_TUNING=0 leaves the allocator alone
    if not tuned:
        pytest.skip("not glibc: nothing to tune")
    # 6 x 30 temporaries of 4-20 MB after a warm-up: untuned, glibc returns many of them to the
    # kernel and faults them in again page by page (counts vary from run to run: 3k-45k per pass)
    assert n_off > 5000
    assert n_tuned < n_off / 3


def test_cli_tunes_the_allocator(monkeypatch):
    from click.testing import CliRunner

    import vsekit.allocator as alloc
    from vsekit.cli import main

    calls = []
    monkeypatch.setattr(alloc, "tune_allocator", lambda: calls.append(1) or True)
    result = CliRunner().invoke(main, ["info", "--help"])
    assert result.exit_code == 0, result.output
    assert calls
