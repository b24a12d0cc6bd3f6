"""What bf16 costs in fidelity: cosine between bf16-autocast and fp32 features of VGG-19 and ResNet-152
(random init, ``--weights none``, seed 0), at real input sizes (224 and 448), global and FNE, through
``vsekit.extract.extract`` (the production path: its taps, its autocast), on the CPU.

    .venv/bin/python -P bench/precision.py                  # 2 images, 224 and 448 (~15 min on 2 busy cores)
    .venv/bin/python -P bench/precision.py --images 2 --sizes 224

Per image, the cosine of the bf16 feature vector with the fp32 one (FNE: the raw tap means, before
standardisation), and the largest relative error of a feature (|bf16 - fp32| / max |fp32|).
Writes bench/results/precision.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--sizes", default="224,448")
    ap.add_argument("--models", default="vgg19,resnet152")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "precision.md"))
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from procs import make_photos  # noqa: E402
    sys.path.pop(0)
    from vsekit.extract import extract
    from vsekit.storage import FeatureStore

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "img"
        root.mkdir()
        paths = make_photos(root, args.images, 640, 480)
        store = FeatureStore.create(Path(tmp) / "s.zarr", dataset="precision", image_root=root)
        store.write_images([str(i) for i in range(len(paths))], [p.name for p in paths], ["test"] * len(paths))
        for model in args.models.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                for kind in ("global", "fne"):
                    feats = {}
                    for prec in ("fp32", "bf16"):
                        t0 = time.perf_counter()
                        name = f"{model}_{kind}_{size}_{prec}"
                        extract(store, model, kind, weights="none", seed=0, input_size=size,
                                resize=size * 256 // 224, crops=1, precision=prec, batch_size=1, workers=0,
                                name=name, progress=False, dtype="float32")
                        feats[prec] = np.asarray(FeatureStore.open(store.path).features(name).data[:], np.float64)
                        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
                    a, b = feats["fp32"], feats["bf16"]
                    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
                    rel = np.abs(a - b).max(1) / np.abs(a).max(1)
                    rows.append((model, size, kind, a.shape[1], float(cos.min()), float(np.median(cos)),
                                 float(rel.max())))
                    print(rows[-1], flush=True)
    lines = [f"Command: `.venv/bin/python -P bench/precision.py --images {args.images} --sizes {args.sizes}`", "",
             "| model | input | kind | dims | cosine min | cosine median | max rel. error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {m} | {s} | {k} | {d} | {cmin:.6f} | {cmed:.6f} | {rel:.2e} |" for m, s, k, d, cmin, cmed, rel in rows]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
