"""How long an interrupted extract with decoding workers takes to be gone, workers included.

An extract of the 24-image demo with ``--workers 2`` (128 px crops, so a decoded batch is more than
a pipe holds and the workers are blocked writing when the signal comes) is held at its third batch
(``VSEKIT_PAUSE``), then stopped three ways: Ctrl-C (SIGINT to the process group: the baseline, the
path that already killed its workers), SIGTERM to the main process, and ``kill -9`` of the main
process. The figure is the seconds from the signal until the main process and every one of its
child processes are gone. The tests (tests/test_decoding_workers.py) assert only that they go.

Usage: ``python -P bench/worker_exit.py [--repeats 3]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SRC = Path(__file__).resolve().parents[1] / "src"
CMD = ["--model", "test_resnet", "--weights", "none", "--input-size", "128", "--resize", "128",
       "--batch-size", "4", "--block-rows", "4", "--workers", "2", "--no-progress"]


def once(how: str, demo: Path, tmp: Path) -> float:
    from vsekit.storage.sources.karpathy import ingest_karpathy

    store, _ = ingest_karpathy(demo / "dataset_demo.json", demo, tmp / f"{how}-{time.time_ns()}.zarr")
    flag = tmp / f"go-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "VSEKIT_PAUSE": "extract:batch@3",
           "VSEKIT_PAUSE_FILE": str(flag)}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())",
                             "extract", "--store", str(store.path), *CMD], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not Path(f"{flag}.reached").exists():
        time.sleep(0.02)
    time.sleep(1.0)   # let the workers fill their pipes
    procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    t0 = time.perf_counter()
    {"ctrl-c": lambda: os.killpg(proc.pid, signal.SIGINT), "sigterm": lambda: os.kill(proc.pid, signal.SIGTERM),
     "kill -9": lambda: os.kill(proc.pid, signal.SIGKILL)}[how]()
    proc.wait()
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs[1:]):
        if time.perf_counter() - t0 > 120:
            return float("inf")
        time.sleep(0.01)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(SRC))
    from vsekit.storage.demo import make_demo_data

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        make_demo_data(tmp / "demo", images=24, seed=1, size=64)
        rows = {how: [once(how, tmp / "demo", tmp) for _ in range(args.repeats)] for how in ("ctrl-c", "sigterm", "kill -9")}
    base = sorted(rows["ctrl-c"])[len(rows["ctrl-c"]) // 2]
    print("| stop | median s until main and workers are gone | runs | ratio vs Ctrl-C |")
    print("| --- | ---: | --- | ---: |")
    for how, secs in rows.items():
        med = sorted(secs)[len(secs) // 2]
        print(f"| {how} | {med:.2f} | {', '.join(f'{s:.2f}' for s in secs)} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
