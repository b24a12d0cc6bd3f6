"""Benchmark: each model's training step against its matmul floor (issue 47, part 3).

The floor of a step is the time its matrix products would take at the machine's sgemm rate: the
step's matmul FLOPs (``torch.profiler`` with ``with_flops``, summed over ``aten::mm``, ``addmm``,
``bmm``, ``baddbmm``, ``conv2d``, forward and backward) divided by the FLOP/s of a square
float32 ``torch.mm`` of ``--gemm`` at the same thread count. The step is ``bench/train_step.py``'s
(vsekit's trainer step: encode, score, hinge loss, extra loss, clip, the preset's optimiser) at the
papers' sizes (batch 128; SMAN 32). Rounds alternate an sgemm measurement and a step, so a load
that changes meets both alike; reported per model: the matmul GFLOP of a step, the median step
time and sgemm rate, and the efficiency floor / step (median of the rounds'; 1.0: the step is its
matrix products at the sgemm rate). Each model runs in its own process, one after the other.

Usage: ``python bench/train_floor.py [--models vse,saf,sgr,sman] [--rounds 3] [--threads 2]
[--gemm 1024] [--out bench/results/train_floor.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the ops whose FLOPs torch's profiler counts that are matrix products (its other counted ops, aten::mul
# and aten::add, are elementwise); a convolution's backward is not counted (VSE++, SAF, SGR have none)
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::conv2d")
BATCH = {"sman": 32}   # the papers' batches: 128, SMAN's 32


def matmul_flops(step) -> float:
    """The matmul FLOPs of one call of ``step`` (forward and backward), as torch's profiler counts them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    return float(sum(e.flops for e in prof.events() if e.name in MATMULS and e.flops))


def sgemm_rate(n: int, repeat: int = 5) -> float:
    """FLOP/s of an n x n float32 matrix product, the best of ``repeat``."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def run_one(name: str, rounds: int, threads: int, gemm: int) -> dict:
    import torch

    sys.path.insert(0, str(HERE))
    from train_step import make_step

    torch.set_num_threads(threads)
    from vsekit.allocator import tune_allocator

    tune_allocator()    # as the vsekit command does
    batch = BATCH.get(name, 128)
    step, _ = make_step(name, batch)
    step()                                  # warm-up: first allocations, the optimiser's state
    flops = matmul_flops(step)
    rates, times, eff = [], [], []
    for _ in range(rounds):
        rates.append(sgemm_rate(gemm))
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        eff.append(flops / rates[-1] / times[-1])
    return {"model": name, "batch": batch, "threads": threads, "matmul_gflop": flops / 1e9,
            "s_per_step": statistics.median(times), "sgemm_gflops": statistics.median(rates) / 1e9,
            "floor_s": flops / statistics.median(rates), "efficiency": statistics.median(eff),
            "times": times, "rates": rates, "load": os.getloadavg()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="vse,saf,sgr,sman")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gemm", type=int, default=1024, help="the side of the square sgemm that gives the rate")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.rounds, args.threads, args.gemm)), flush=True)
        return
    results = []
    for name in args.models.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--rounds", str(args.rounds), "--threads", str(args.threads),
               "--gemm", str(args.gemm)]
        res = subprocess.run(cmd, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        if res.returncode != 0:
            print(f"{name}: failed (exit {res.returncode})\n{res.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(res.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{name} (batch {r['batch']}, {args.threads} threads): {r['matmul_gflop']:.1f} GFLOP of matmuls a step, "
              f"sgemm {r['sgemm_gflops']:.1f} GFLOP/s: floor {r['floor_s']:.3f} s, step {r['s_per_step']:.3f} s, "
              f"efficiency {r['efficiency']:.2f} (load {r['load'][0]:.1f})", flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
