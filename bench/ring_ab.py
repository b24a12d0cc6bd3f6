"""Benchmark: extraction end to end with and without the decoding workers' ring of batch buffers (issue 37).

``vsekit.extract.extract`` of ``--images`` 640x480 JPEGs (10 crops of 224, batch 32, ``--workers``
decoding workers) with a real backbone (random weights), alternating: the ring (each worker's batches
in ``prefetch + 1`` reused shared buffers, ``reader.BufferRing``, the default) and no ring (a fresh
shared segment per batch, as torch's default collate does; the same ``batch_tensor`` with ``ring=0``,
patched before the workers fork). Reported per run: images/s (wall), the driving process's CPU per
image and its decoding workers' (``os.times``). The first run warms the device (cuDNN's algorithm
search, the model's weights): compare the runs after it.

    python bench/ring_ab.py --device cuda --precision bf16 --images 800 --rounds 3 --out bench/results/ring-ab.json
    python bench/ring_ab.py --device cpu --model vgg19 --images 96 --workers 1 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=800)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (no ring, ring), after a warm-up run")
    ap.add_argument("--model", default="vgg19")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import procs
    from vsekit.extract import extract, reader
    from vsekit.storage import FeatureStore

    orig = reader.batch_tensor
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = procs.make_photos(root / "img", args.images)
        store = root / "s.zarr"
        fs = FeatureStore.create(store, dataset="ab", image_root=str(root / "img"))
        fs.write_images([str(i) for i in range(args.images)], [p.name for p in paths], ["train"] * args.images)
        plan = [False] + [ring for _ in range(args.rounds) for ring in (False, True)]
        for k, ring in enumerate(plan):
            reader.batch_tensor = orig if ring else (lambda shape, ring=0: orig(shape, 0))
            try:
                t0, c0 = time.perf_counter(), os.times()
                r = extract(str(store), args.model, "global", weights="none", crops=10, resize=256, input_size=224,
                            batch_size=32, workers=args.workers, device=args.device, precision=args.precision,
                            name=f"ab{k}", progress=False)
                wall, c1 = time.perf_counter() - t0, os.times()
            finally:
                reader.batch_tensor = orig
            rec = {"run": k, "warm_up": k == 0, "ring": ring, "img_s": round(r.done / wall, 1),
                   "wall_s": round(wall, 2),
                   "driver_cpu_ms_img": round(1e3 * (c1.user + c1.system - c0.user - c0.system) / args.images, 2),
                   "workers_cpu_ms_img": round(1e3 * (c1.children_user + c1.children_system - c0.children_user
                                                      - c0.children_system) / args.images, 2)}
            print(json.dumps(rec), flush=True)
            res.append(rec)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
