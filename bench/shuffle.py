"""Experiment: does the training shuffle window change the learning curves?

The reference loaders shuffle all pairs globally; vsekit used to draw each batch from a window of 8
chunks (for SGRAF regions, 113 rows a chunk: 904 images, so a batch of 128 pairs with every caption
holds about 7 pairs of pairs that share an image, against about 0.06 globally). This trains the same
model on the same data with both shuffles, a few seeds each, and compares the validation rsum per
epoch: the difference of the means against the spread of the seeds.

Data: the synthetic demo set (``make_demo_data``), ``--images`` images of which 80% train, pixel
features in chunks of 113 rows (as SGRAF's regions), so the 8-chunk window holds 904 of the ~4,000
training images. Model: VSE (GRU, embed 128), every caption, batch 128, the hardest-negative loss
(VSE++), where fewer distinct negatives would show first.

    python -P bench/shuffle.py [--images 5000] [--seeds 3] [--first-seed 0] [--epochs 6]
        [--out bench/results/shuffle.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def build(root: Path, images: int) -> str:
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    make_demo_data(root, images=images, seed=0, size=32, val_fraction=0.1, test_fraction=0.1)
    store, _ = ingest_karpathy(root / "dataset_demo.json", root, root / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=113)
    return str(root / "s.zarr")


def run(store: str, out: Path, seed: int, epochs: int, window_chunks: int | None) -> list[float]:
    from vsekit.train import train

    train(store, "pixels", "vse", out, presets=["demo"], progress=False, epochs=epochs, seed=seed,
          captions="all", max_violation=True, batch_size=128, lr=2e-3, window_chunks=window_chunks)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["val"]["rsum"] for r in rows[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--out", default="bench/results/shuffle.md")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        store = build(tmp / "data", args.images)
        curves: dict[str, list[list[float]]] = {"window": [], "global": []}
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        for seed in seeds:
            for mode, chunks in (("window", 8), ("global", None)):
                curves[mode].append(run(store, tmp / f"{mode}{seed}", seed, args.epochs, chunks))
                print(mode, seed, [round(x, 1) for x in curves[mode][-1]], flush=True)
        wall = time.perf_counter() - t0
    w, g = np.array(curves["window"]), np.array(curves["global"])
    lines = [f"# Shuffle window vs global shuffle ({args.images} demo images, seeds {seeds}, VSE, "
             "all captions, batch 128, hardest negative)", "",
             "Validation rsum per epoch, mean ± std over seeds (seed s: same initialisation for both).", "",
             "| epoch | window of 8 chunks (904 images) | global | global − window | seed std (pooled) |",
             "| --- | --- | --- | --- | --- |"]
    for e in range(w.shape[1]):
        pooled = float(np.sqrt((w[:, e].var(ddof=1) + g[:, e].var(ddof=1)) / 2)) if args.seeds > 1 else float("nan")
        lines.append(f"| {e + 1} | {w[:, e].mean():.1f} ± {w[:, e].std(ddof=1):.1f} | "
                     f"{g[:, e].mean():.1f} ± {g[:, e].std(ddof=1):.1f} | {g[:, e].mean() - w[:, e].mean():+.1f} | "
                     f"{pooled:.1f} |")
    best_w, best_g = w.max(1), g.max(1)
    lines += ["", f"Best rsum per run: window {np.round(best_w, 1).tolist()}, global {np.round(best_g, 1).tolist()}; "
              f"mean difference {best_g.mean() - best_w.mean():+.1f}.", "",
              f"Command: `python -P bench/shuffle.py --images {args.images} --seeds {args.seeds} "
              f"--first-seed {args.first_seed} --epochs {args.epochs}` ({wall / 60:.0f} min on this machine).", "",
              "Curves (JSON): " + json.dumps(curves), ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
