"""Benchmark: extraction throughput in-process vs ``--cluster local:2`` vs ``--cluster slurm:2`` (two
SLURM jobs of one worker each, "two nodes' worth" of workers) on this machine, in one run.

    .venv/bin/python bench/cluster.py                       # 96 images, ResNet-18 global, input 112
    .venv/bin/python bench/cluster.py --images 192 --repeat 2

The SLURM leg starts a throw-away single-node SLURM on 127.0.0.1 (tests/slurm_local.py: needs root,
Debian's slurm-wlm and munge, and dask-jobqueue); where it cannot, that row says why. Each leg extracts
the same images into a fresh store; the figure is images per second of the whole ``extract`` call,
cluster start-up included (a cluster leg pays worker start-up and one model build per worker), and
the ratio is to the in-process run. Writes a Markdown table to bench/results/cluster.md (``--out``).
Random weights (``--weights none``): speed does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# bench/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.append(str(HERE.parent / "tests"))  # slurm_local


def make_store(root: Path, n: int):
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy

    data = root / "data"
    if not data.exists():
        make_demo_data(data, images=n, seed=0, size=160)
    store, _ = ingest_karpathy(data / "dataset_demo.json", data, root / f"s{time.time_ns()}.zarr")
    return store


def leg(root: Path, n: int, opts: dict, cluster: str | None) -> float:
    from vsekit.extract import extract

    store = make_store(root, n)
    t0 = time.perf_counter()
    res = extract(store, cluster=cluster, **opts)
    seconds = time.perf_counter() - t0
    assert res.done == n, res.summary()
    return n / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--input-size", type=int, default=112)
    ap.add_argument("--repeat", type=int, default=1, help="Runs per leg (the best is kept).")
    ap.add_argument("--out", default=str(HERE / "results" / "cluster.md"))
    args = ap.parse_args()
    import torch

    cpus = os.cpu_count() or 1
    torch.set_num_threads(min(2, cpus))
    opts = dict(model=args.model, kind="global", weights="none", input_size=args.input_size,
                resize=args.input_size, crops=1, batch_size=16, block_rows=16, workers=1, device="cpu",
                progress=False)
    rows: list[tuple[str, str, float | None, str]] = []
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        make_store(root, args.images)  # the images, made once
        best = lambda spec: max(leg(root, args.images, opts, spec) for _ in range(args.repeat))  # noqa: E731
        rows.append(("in-process", f"1 process, {torch.get_num_threads()} torch threads, 1 decoder", best(None), ""))
        rows.append(("local:2", "2 single-threaded dask workers", best("local:2"), ""))
        import slurm_local

        why = slurm_local.unavailable()
        if why:
            rows.append(("slurm:2", "2 SLURM jobs x 1 worker", None, why))
        else:
            with slurm_local.local_slurm(root / "slurm") as env:
                os.environ["SLURM_CONF"] = env["SLURM_CONF"]
                os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"),
                                                            os.environ.get("PYTHONPATH", "")])
                os.environ["VSEKIT_CLUSTER_CONFIG"] = json.dumps(
                    {"interface": "lo", "cores": 1, "memory": "2GB", "queue": "vsekit",
                     "python": sys.executable, "log_directory": str(root / "jobs")})
                rows.append(("slurm:2", "2 SLURM jobs x 1 single-threaded worker", best("slurm:2"), ""))
    base = rows[0][2]
    lines = [f"Extraction throughput, {args.images} images ({args.model} global, input {args.input_size}, "
             f"random weights, batch 16, CPU; {cpus} cores on this machine; start-up included)", "",
             "| where | workers | img/s | vs in-process |", "| --- | --- | ---: | ---: |"]
    for name, what, speed, note in rows:
        if speed is None:
            lines.append(f"| {name} | {what} | n/a | {note} |")
        else:
            lines.append(f"| {name} | {what} | {speed:.1f} | {speed / base:.2f}x |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
