"""Benchmark: a node's memory for the training window with data-parallel ranks (issue 38, item 4).

``vsekit train --nproc-per-node R --captions all`` (gloo ranks on the CPU) on a store of global
features made here (``--images`` train images x 5 captions, ``--dim`` float32 features a row), with
a ``--shuffle-memory`` window that holds the whole split, run

- with the window shared by the node's ranks (the default: local rank 0 reads it into ``/dev/shm``),
- with every rank reading its own rows (``VSEKIT_SHARED_WINDOW_DIR`` pointing at a missing folder:
  the fallback),
- in one process (the budget's reference),

each a whole ``vsekit train`` process tree. Sampled every 0.1 s: the sum over the tree's processes of
their proportional set size (PSS: a shared page counts 1/n in each of its n processes, so the sum is
what the node holds, the shared window included) and the growth of ``/dev/shm``'s use (any other
process's use included: an idle machine gives a clean figure); reported: the peaks, and the window's
bytes.

Usage: ``python bench/train_window.py [--images 1500] [--dim 6144] [--ranks 2] [--out ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_store(path: Path, images: int, dim: int) -> None:
    import numpy as np

    sys.path.insert(0, str(ROOT / "src"))
    from vsekit.storage.store import FeatureStore
    from vsekit.tokenize import tokenize

    rng = np.random.default_rng(0)
    n_val = 20
    n = images + 2 * n_val
    store = FeatureStore.create(path, dataset="window-bench")
    store.write_images([f"im{i}" for i in range(n)], [f"{i}.jpg" for i in range(n)],
                       ["train"] * images + ["val"] * n_val + ["test"] * n_val)
    rows = np.repeat(np.arange(n), 5)
    words = [f"w{i}" for i in range(200)]
    store.write_captions([" ".join(rng.choice(words, rng.integers(4, 12))) for _ in rows], rows)
    tokenize(store, min_count=1)
    fs = store.create_features("global", (dim,), "float32", block_rows=64, attrs={"kind": "global"})
    for b in fs.blocks():
        fs.write_block(b, rng.standard_normal((len(b), dim), dtype=np.float32))


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def run(args, store: Path, out: Path, ranks: int, env_extra: dict) -> dict:
    import psutil

    cmd = [sys.executable, "-m", "vsekit.cli", "train", "--store", str(store), "--features", "global",
           "--model", "vse", "--out", str(out), "--embed-dim", "32", "--word-dim", "16", "--batch-size", "64",
           "--epochs", "1", "--captions", "all", "--no-progress", "--device", "cpu",
           "--shuffle-memory", str(args.shuffle_memory_gb)]
    if ranks > 1:
        cmd += ["--nproc-per-node", str(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **env_extra}
    base_shm = shm_used()
    peak = {"pss": 0, "shm": 0}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stop = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_full_info().pss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except psutil.NoSuchProcess:
                break
            peak["pss"] = max(peak["pss"], total)
            peak["shm"] = max(peak["shm"], shm_used() - base_shm)
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    output, _ = proc.communicate()
    stop.set()
    t.join()
    if proc.returncode:
        raise SystemExit(f"train failed ({proc.returncode}):\n{output[-3000:]}")
    return {"ranks": ranks, "peak_pss_mb": round(peak["pss"] / 2**20, 1), "peak_shm_mb": round(peak["shm"] / 2**20, 1),
            "shared_note": [line for line in output.splitlines() if "not shared" in line]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--dim", type=int, default=6144)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    window_mb = args.images * args.dim * 4 / 2**20
    args.shuffle_memory_gb = round(1.2 * window_mb / 1024, 4)   # the whole split is one window
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_store(tmp / "s.zarr", args.images, args.dim)
        res = {"images": args.images, "dim": args.dim, "window_mb": round(window_mb, 1),
               "shuffle_memory_gb": args.shuffle_memory_gb, "load_before": os.getloadavg()}
        res["one_process"] = run(args, tmp / "s.zarr", tmp / "one", 1, {})
        res["shared"] = run(args, tmp / "s.zarr", tmp / "shared", args.ranks, {})
        res["per_rank"] = run(args, tmp / "s.zarr", tmp / "own", args.ranks,
                              {"VSEKIT_SHARED_WINDOW_DIR": str(tmp / "no-such-folder")})
        res["load_after"] = os.getloadavg()
    for k in ("one_process", "shared", "per_rank"):
        r = res[k]
        print(f"{k:12s} ranks {r['ranks']}: peak PSS of the process tree {r['peak_pss_mb']:8.1f} MB, "
              f"/dev/shm {r['peak_shm_mb']:7.1f} MB  (window {res['window_mb']} MB){' ' + r['shared_note'][0] if r['shared_note'] else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
