"""Benchmark: decoding-worker CPU per image, vsekit's decode paths against plain pipelines.

One process, one core (``torch.set_num_threads(1)``), CPU time (``time.process_time``) per image
for: 10 crops and 1 crop of 224 from 640x480 JPEGs (synthetic photos: gradients + noise, quality
90), resize 256 (shorter side), bilinear.

- ``vsekit-old``: the reader before issue 30: ``make_crops(load_image(path))`` (PIL decode, PIL
  resize, crops stacked and transposed to CHW);
- ``vsekit-pil``: ``decode_crops(path, decoder="pil")`` (NHWC, same pixels as vsekit-old);
- ``vsekit-turbo``: ``decode_crops(path, decoder="turbo")`` (torch's uint8 resize);
- ``plain-pil``: a plain PIL + torchvision.transforms script (``Image.open().convert("RGB")``,
  ``T.Resize(256)``, ``T.TenCrop(224)`` / ``T.CenterCrop(224)``, ``T.PILToTensor``, ``torch.stack``);
- ``plain-tv``: ``torchvision.io.decode_jpeg`` + ``transforms.v2.functional.resize`` +
  ``ten_crop`` / ``center_crop``, ``torch.stack`` (the baseline of the ratios).

Each pipeline's output is one contiguous uint8 array of the image's crops (what a batch needs).
The pipelines run interleaved, ``--rounds`` times; the figure of each is the median over rounds.

    .venv/bin/python -P bench/decode.py                 # 200 images, 3 rounds (~1-2 min on 2 busy cores)
    .venv/bin/python -P bench/decode.py --images 50 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def make_photos(root: Path, n: int, width: int = 640, height: int = 480, seed: int = 0) -> list[Path]:
    """``n`` photo-like JPEGs (smooth gradients, blobs and sensor-like noise), quality 90."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(n):
        a = rng.uniform(0.1, 0.6, 3)
        base = np.stack([x * a[0] + y * (1 - a[0]) * 0.5, y * a[1] + 40, (x + y) * a[2] * 0.3 + 20], -1)
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(40, 200)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None] * rng.uniform(-120, 120, 3)
        img = base + blob + rng.normal(0, 12, (height, width, 3))
        p = root / f"p{i:04d}.jpg"
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(p, quality=90)
        paths.append(p)
    return paths


def pipelines(n_crops: int, resize: int = 256, crop: int = 224) -> dict:
    import torch
    import torchvision.transforms as T
    import torchvision.transforms.v2.functional as F
    from PIL import Image
    from torchvision.io import decode_jpeg, read_file

    from vsekit.extract.images import decode_crops, load_image, make_crops

    cut = T.TenCrop(crop) if n_crops == 10 else T.CenterCrop(crop)
    to_t = T.PILToTensor()
    resize_t = T.Resize(resize)

    def plain_pil(p):
        img = resize_t(Image.open(p).convert("RGB"))
        crops = cut(img)
        crops = crops if isinstance(crops, tuple) else (crops,)
        return torch.stack([to_t(c) for c in crops])

    def plain_tv(p):
        img = F.resize(decode_jpeg(read_file(str(p))), [resize], antialias=True)
        crops = F.ten_crop(img, [crop, crop]) if n_crops == 10 else (F.center_crop(img, [crop, crop]),)
        return torch.stack(crops)

    return {
        "vsekit-old": lambda p: make_crops(load_image(p), resize, crop, n_crops),
        "vsekit-pil": lambda p: decode_crops(p, resize, crop, n_crops, decoder="pil"),
        "vsekit-turbo": lambda p: decode_crops(p, resize, crop, n_crops, decoder="turbo"),
        "plain-pil": plain_pil,
        "plain-tv": plain_tv,
    }


def measure(paths, rounds: int) -> dict:
    """{crops: {pipeline: [ms per image per round]}}, pipelines interleaved within each round."""
    out = {}
    for n_crops in (10, 1):
        fns = pipelines(n_crops)
        for fn in fns.values():   # warm-up: imports, first calls
            fn(paths[0])
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.process_time()
                for p in paths:
                    fn(p)
                times[name].append((time.process_time() - t0) / len(paths) * 1e3)
        out[n_crops] = times
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.md"))
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_photos(Path(tmp), args.images)
        res = measure(paths, args.rounds)
    lines = [f"Command: `.venv/bin/python -P bench/decode.py --images {args.images} --rounds {args.rounds}`", "",
             f"{args.images} JPEGs 640x480 (q90), resize 256, crops of 224, 1 torch thread, CPU time per image "
             f"(median of {args.rounds} interleaved rounds); ratio = pipeline / plain-tv (decode_jpeg + "
             "transforms.v2).", "",
             "| pipeline | 10 crops ms/img | ratio | 1 crop ms/img | ratio |", "| --- | --- | --- | --- | --- |"]
    med = {c: {k: statistics.median(v) for k, v in t.items()} for c, t in res.items()}
    for name in med[10]:
        lines.append(f"| {name} | {med[10][name]:.2f} | {med[10][name] / med[10]['plain-tv']:.2f} | "
                     f"{med[1][name]:.2f} | {med[1][name] / med[1]['plain-tv']:.2f} |")
    text = "\n".join(lines)
    print(text)
    print(json.dumps({str(c): {k: [round(x, 3) for x in v] for k, v in t.items()} for c, t in res.items()}))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
