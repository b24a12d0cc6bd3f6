"""Benchmark ``vsekit tokenize``: captions/s and peak memory, single process against parallel workers.

Generates a COCO-sized store (default 120,000 images × 5 = 600,000 captions; Karpathy-like splits,
Zipf-distributed words from a 12k-word vocabulary, capitalised first words, commas, final periods
and possessives in realistic proportions), then tokenises it in fresh subprocesses: once with
``workers=1`` (the baseline) and once with ``--workers`` processes, each run measured by wall time
and peak RSS (driver, and the largest worker). Results go to stdout and, with ``--out``, to a
markdown file.

    .venv/bin/python bench/tokenize.py                   # 600k captions, 1 vs 2 processes
    .venv/bin/python bench/tokenize.py --captions 60000  # quick
"""

from __future__ import annotations

import os
import sys

# This file is named like Python's own ``tokenize`` module, and running it puts bench/ first on
# sys.path, where it would shadow the standard library (linecache, inspect... import tokenize).
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import json
import platform
import resource
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def make_store(path: Path, n_captions: int, seed: int = 0) -> None:
    from vsekit.storage import FeatureStore

    rng = np.random.default_rng(seed)
    n_images = max(3, n_captions // 5)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = sorted({"".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(12000)})
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    store = FeatureStore.create(path, dataset="bench", overwrite=True)
    n_test = n_val = max(1, n_images // 24)
    splits = ["train"] * (n_images - n_val - n_test) + ["val"] * n_val + ["test"] * n_test
    store.write_images([str(i) for i in range(n_images)], [f"{i}.jpg" for i in range(n_images)], splits)
    lengths = rng.integers(8, 16, size=n_captions)
    words = rng.choice(len(vocab), size=int(lengths.sum()), p=zipf)
    kind = rng.random(size=n_captions)
    texts, pos = [], 0
    for m, n in enumerate(lengths):
        w = [vocab[i] for i in words[pos:pos + n]]
        pos += n
        w[0] = w[0].capitalize()
        if kind[m] < 0.15:
            w[n // 2] += ","
        elif kind[m] < 0.20:
            w[n // 3] += "'s"
        texts.append(" ".join(w) + ("." if kind[m] > 0.4 else ""))
    store.write_captions(texts, np.arange(n_captions) % n_images)


def _vm_hwm_mib() -> float:
    """This process's own peak RSS (VmHWM; unlike ru_maxrss it does not include the pages of the
    parent this process was forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _ChildSampler(threading.Thread):
    """Samples the RSS of this process's children (the worker processes) every 50 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_one = self.peak_sum = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.wait(0.05):
            sizes = []
            for child in me.children(recursive=True):
                try:
                    sizes.append(child.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
            if sizes:
                self.peak_one, self.peak_sum = max(self.peak_one, max(sizes)), max(self.peak_sum, sum(sizes))


def run_one(store: str, workers: int) -> dict:
    """Tokenise in this (fresh) process; report wall time and peak RSS."""
    from vsekit.tokenize import tokenize

    sampler = _ChildSampler()
    sampler.start()
    t0 = time.perf_counter()
    summary = tokenize(store, workers=workers)
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    return {"workers": workers, "wall_s": wall, "captions": summary.captions, "tokens": summary.tokens,
            "vocabulary": summary.vocabulary, "driver_peak_mib": _vm_hwm_mib(),
            "worker_peak_mib": sampler.peak_one if workers > 1 else None,
            "workers_total_peak_mib": sampler.peak_sum if workers > 1 else None}


def digest(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted((path / "tokens").rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", type=int, default=600_000)
    ap.add_argument("--workers", type=int, default=2, help="processes for the parallel run")
    ap.add_argument("--out", type=Path, default=None, help="write a markdown table here")
    ap.add_argument("--_run", nargs=2, metavar=("STORE", "WORKERS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._run:
        print(json.dumps(run_one(args._run[0], int(args._run[1]))))
        return

    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "bench.zarr"
        t0 = time.perf_counter()
        make_store(store, args.captions)
        print(f"generated {args.captions} captions in {time.perf_counter() - t0:.1f}s", flush=True)
        text_mib = sum(p.stat().st_size for p in (store / "captions").rglob("*") if p.is_file()) / 2**20
        rows, digests = [], []
        for workers in (1, args.workers):
            out = subprocess.run([sys.executable, __file__, "--_run", str(store), str(workers)],
                                 check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            digests.append(digest(store))
            print(rows[-1], flush=True)
    base = rows[0]["wall_s"]
    lines = [
        f"captions: {args.captions:,} (stored caption arrays {text_mib:.1f} MiB compressed); "
        f"tokens: {rows[0]['tokens']:,}; vocabulary: {rows[0]['vocabulary']:,}; "
        f"identical tokens/ from both runs: {digests[0] == digests[1]}",
        "",
        "| run | wall s | captions/s | speed-up vs 1 process | driver peak RSS MiB | peak RSS per worker MiB | "
        "all workers MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        name = "1 process (baseline)" if r["workers"] == 1 else f"{r['workers']} worker processes"
        worker = f"{r['worker_peak_mib']:.0f}" if r["worker_peak_mib"] else "-"
        total = f"{r['workers_total_peak_mib']:.0f}" if r["workers_total_peak_mib"] else "-"
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['captions'] / r['wall_s']:,.0f} | "
                     f"{base / r['wall_s']:.2f}× | {r['driver_peak_mib']:.0f} | {worker} | {total} |")
    load = os.getloadavg()[0]
    lines += ["", f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
              f"shared with other jobs (1-min load average {load:.1f} at the end of the run)",
              f"command: `.venv/bin/python bench/tokenize.py --captions {args.captions} --workers {args.workers}`"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
