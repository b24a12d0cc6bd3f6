"""Benchmark: the driving thread's own CPU per image during extraction, outside the model.

A near-free model (one 1×1 convolution, registered here as the backbone ``bench_free``) on 10 crops
of 224 from 640×480 JPEGs, ``--no-channels-last``, decoding in worker processes: what the thread
that drives the model spends per image on everything but normalising and the model itself
(receiving decoded batches, stacking, bookkeeping, handing blocks to the writer), timed inside the
run with ``time.thread_time`` (the driving thread's CPU only: decoding processes, the writer thread
and torch's other threads are not counted). In the same run, the same images through a plain
torchvision pipeline (``DataLoader`` workers, ``transforms`` Resize + TenCrop, default collate).

    .venv/bin/python bench/host.py                       # 96 images, 2 decoding workers, batch 16
    .venv/bin/python bench/host.py --images 128 --workers 2 --repeat 3

Issue 30's target: at most 0.35 ms per 10-crop image in the driving thread. (The decoding
processes' CPU per image is bench/decode.py's subject.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def register_free_model() -> None:
    import torch

    from vsekit.extract.backbones import BackboneSpec, Preprocess, register_backbone

    class Free(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 1)
            self.pool = torch.nn.AdaptiveAvgPool2d(1)
            self.flat = torch.nn.Flatten()

        def forward(self, x):
            return self.flat(self.pool(self.conv(x)))

    register_backbone(BackboneSpec(
        name="bench_free", build=lambda pretrained: Free(),
        preprocess=lambda m: Preprocess(crop_size=224, resize=256, mean=MEAN, std=STD, interpolation="bilinear"),
        global_tap=lambda m: "flat", conv_tap=lambda m: "conv", fne_taps=lambda m: ["flat"]))
    return Free


def make_images(folder: Path, n: int) -> list[Path]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    base = rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)
    paths = []
    for i in range(n):
        img = Image.fromarray(np.roll(base, i, axis=1)).resize((640, 480), Image.BILINEAR)
        p = folder / f"{i:05d}.jpg"
        img.save(p, quality=90)
        paths.append(p)
    return paths


def vsekit_run(store_path: Path, workers: int, batch: int) -> dict:
    """One extraction; the driving thread's CPU in the steady state of the block loop (from the
    first decoded batch on: starting the decoding processes is left out), less normalise + model."""
    import torch

    from vsekit.extract import extract, extractor as ex, rows, runner
    from vsekit.storage import FeatureStore

    model_cpu = [0.0]
    loop = {"first": 0}
    real_features = ex.Extractor.features

    def features(self, crops):
        t = time.thread_time()
        try:
            return real_features(self, crops)
        finally:
            if "t0" in loop:
                model_cpu[0] += time.thread_time() - t

    def decoded(*args, **kwargs):
        for items in real_decoded(*args, **kwargs):
            if "t0" not in loop:   # the first batch: the clock starts once it has arrived
                loop["first"] = len(items)
                yield items
                loop["t0"] = time.thread_time()
                continue
            yield items

    old = not hasattr(rows, "decoded")   # vsekit before the block engine (the baseline commit)
    where = runner if old else rows
    real_decoded = where.iter_batches if old else rows.decoded
    ex.Extractor.features = features
    setattr(where, "iter_batches" if old else "decoded", decoded)
    real_close = runner.BlockWriter.close

    def close(self):   # the loop has ended: stop the clock before waiting for the writer
        loop.setdefault("t1", time.thread_time())
        return real_close(self)

    runner.BlockWriter.close = close
    try:
        torch.set_num_threads(1)
        layout = {"channels_last": False}
        if old:
            from vsekit.extract.throughput import apply

            apply(channels_last=False)
            layout = {}
        res = extract(store_path, model="bench_free", crops=10, weights="none", workers=workers,
                      batch_size=batch, device="cpu", progress=False, overwrite=True, block_rows=batch * 8,
                      **layout)
    finally:
        ex.Extractor.features, runner.BlockWriter.close = real_features, real_close
        setattr(where, "iter_batches" if old else "decoded", real_decoded)
    n = res.images - loop["first"]
    loop_cpu = loop["t1"] - loop["t0"]
    assert FeatureStore.open(store_path).features(res.name).counts()["done"] == res.images
    return {"images": n, "driving_ms": 1e3 * (loop_cpu - model_cpu[0]) / n, "model_ms": 1e3 * model_cpu[0] / n}


class PlainDataset:
    def __init__(self, paths):
        from torchvision import transforms as T

        self.paths = paths
        self.t = T.Compose([T.Resize(256), T.TenCrop(224)])
        self.to_tensor = T.PILToTensor()

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch
        from PIL import Image

        img = Image.open(self.paths[i]).convert("RGB")
        return torch.stack([self.to_tensor(c) for c in self.t(img)])


def plain_run(paths, workers: int, batch: int, Free) -> dict:
    """The plain torchvision pipeline's driving thread, less normalise + the same model."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    model = Free().eval()
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    loader = DataLoader(PlainDataset(paths), batch_size=batch, num_workers=workers)
    model_cpu, n = 0.0, 0
    it = iter(loader)
    first = next(it)   # as for vsekit: the clock starts once the first batch has arrived
    b = first.shape[0]
    with torch.inference_mode():
        model(((first.reshape(-1, *first.shape[2:]).float() - mean) / std)).reshape(b, 10, -1).mean(1)
    t0 = time.thread_time()
    for x in it:
        t = time.thread_time()
        with torch.inference_mode():
            b = x.shape[0]
            y = model(((x.reshape(-1, *x.shape[2:]).float() - mean) / std)).reshape(b, 10, -1).mean(1)
            y.numpy().copy()
        model_cpu += time.thread_time() - t
        n += x.shape[0]
    total = time.thread_time() - t0
    return {"images": n, "driving_ms": 1e3 * (total - model_cpu) / n, "model_ms": 1e3 * model_cpu / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()

    Free = register_free_model()
    from vsekit.storage import FeatureStore

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = make_images(root / "img", args.images)
        store = FeatureStore.create(root / "s.zarr", dataset="host", image_root=str(root / "img"))
        store.write_images([str(i) for i in range(len(paths))], [p.name for p in paths], ["train"] * len(paths))
        rows = []
        for _ in range(args.repeat):
            rows.append({"vsekit": vsekit_run(root / "s.zarr", args.workers, args.batch),
                         "plain": plain_run(paths, args.workers, args.batch, Free)})
    best = {k: min(r[k]["driving_ms"] for r in rows) for k in ("vsekit", "plain")}
    print(json.dumps({"args": vars(args), "runs": rows, "best_driving_ms": best}, indent=1))
    print(f"driving thread CPU per 10-crop image, outside normalise + model (best of {args.repeat}): "
          f"vsekit {best['vsekit']:.3f} ms, plain torchvision {best['plain']:.3f} ms "
          f"(ratio {best['vsekit'] / best['plain']:.2f}); target <= 0.35 ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": rows, "best": best}, indent=1))


if __name__ == "__main__":
    main()
