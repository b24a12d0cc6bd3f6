"""Whole-process CPU per image of an extraction, as a GPU would wait on it (issue 37).

Shared by ``bench/host.py`` (the driving process) and ``bench/decode.py`` (the decoding worker).
Every figure is a whole process's CPU from ``getrusage`` (user + system): the process that drives
the model as ``RUSAGE_SELF``, its decoding worker as ``RUSAGE_CHILDREN`` (reaped when the
DataLoader shuts it down), from after the imports (their CPU varies by seconds on a loaded machine)
to the end of the run. Each leg runs in a fresh Python process, once on 48 and once on 240 images;
the steady state per image is the difference divided by 192, so start-up (forking the worker,
building the model, creating the set) cancels out.

Legs:

- ``plain``: a plain torch ``DataLoader`` (1 worker, batch 32, default collate) over a dataset
  whose item is ``decode_jpeg(read_file(p))`` → ``transforms.v2.functional.resize(256)`` →
  ``ten_crop(224)`` (or ``center_crop``) stacked; the driving loop normalises, runs the same
  near-free model and takes the crop mean to numpy. Inside that loop it also times (``thread_time``)
  normalise + forward of the same tensors, in NCHW and in channels-last (tensors and model; the
  uint8 conversion to channels-last is outside the timing, as vsekit's decoders deliver NHWC), and
  channels-last exactly as vsekit normalises (a float32 buffer kept between batches, ``sub_`` /
  ``div_`` in place on the NHWC rows): the "model" that the driving-process figure of vsekit is
  measured beyond.
- ``vsekit``: ``vsekit.extract.extract`` with ``--workers 1``, batch 32, the same model registered as
  the backbone ``bench_free``, a ``--decoder`` and ``--channels-last`` or not.

All legs: ``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``, 640x480 JPEGs (quality 90),
resize 256 (shorter side), crops of 224, bilinear.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SMALL, LARGE = 48, 240
BATCH = 32


def free_model():
    import torch

    class Free(torch.nn.Module):
        """Pooled, then one linear layer: a model that costs next to nothing beyond reading its input
        once (a 1x1 convolution over the crops costs 24 ms per 10-crop image channels-last and 60 ms
        NCHW on one core here, which would drown the host's figure)."""

        def __init__(self, conv: bool = False):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 1) if conv else torch.nn.Identity()
            self.pool = torch.nn.AdaptiveAvgPool2d(1)
            self.flat = torch.nn.Flatten()
            self.fc = torch.nn.Linear(8 if conv else 3, 8)

        def forward(self, x):
            return self.fc(self.flat(self.pool(self.conv(x))))

    return Free


def register_free_model():
    from vsekit.extract.backbones import BackboneSpec, Preprocess, register_backbone

    Free = free_model()
    register_backbone(BackboneSpec(
        name="bench_free", build=lambda pretrained: Free(),
        preprocess=lambda m: Preprocess(crop_size=224, resize=256, mean=MEAN, std=STD, interpolation="bilinear"),
        global_tap=lambda m: "fc", conv_tap=lambda m: "pool", fne_taps=lambda m: ["fc"]))
    return Free


def make_photos(root: Path, n: int, width: int = 640, height: int = 480, seed: int = 0) -> list[Path]:
    """``n`` photo-like JPEGs (smooth gradients, a blob, sensor-like noise), quality 90."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    root.mkdir(parents=True, exist_ok=True)
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


def make_stores(root: Path) -> dict[int, Path]:
    """The images and one store per size (48, 240) over the same files."""
    from vsekit.storage import FeatureStore

    paths = make_photos(root / "img", LARGE)
    stores = {}
    for n in (SMALL, LARGE):
        s = root / f"s{n}.zarr"
        store = FeatureStore.create(s, dataset=f"bench{n}", image_root=str(root / "img"))
        store.write_images([str(i) for i in range(n)], [p.name for p in paths[:n]], ["train"] * n)
        stores[n] = s
    return stores


def _cpu(who) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


# --- the legs, each in its own process ---------------------------------------------------------------
def leg_vsekit(store: str, crops: int, decoder: str, channels_last: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    register_free_model()
    from vsekit.extract import extract

    res = extract(store, model="bench_free", crops=crops, weights="none", workers=1, batch_size=BATCH,
                  device="cpu", progress=False, overwrite=True, decoder=decoder, channels_last=channels_last)
    return {"images": res.images}


class PlainDataset:
    def __init__(self, paths, crops: int):
        self.paths, self.crops = paths, crops

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        import torch
        import torchvision.transforms.v2.functional as F
        from torchvision.io import decode_jpeg, read_file

        img = F.resize(decode_jpeg(read_file(self.paths[i])), [256], antialias=True)
        if self.crops == 10:
            return torch.stack(F.ten_crop(img, [224, 224]))
        return F.center_crop(img, [224, 224])[None]


def leg_plain(folder: str, n: int, crops: int) -> dict:
    import warnings

    import torch
    from torch.utils.data import DataLoader

    warnings.simplefilter("ignore", DeprecationWarning)   # torchvision: "use torchcodec"
    torch.set_num_threads(1)
    paths = sorted(str(p) for p in Path(folder).glob("*.jpg"))[:n]
    Free = free_model()
    nchw = Free().eval()
    cl = Free().eval().to(memory_format=torch.channels_last)
    cl.load_state_dict(nchw.state_dict())
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255
    model_s = {"nchw": 0.0, "channels_last": 0.0, "channels_last_inplace": 0.0, "channels_last_vsekit": 0.0,
               "probe": 0.0}
    rows_mean, rows_std = mean.reshape(3).repeat(224), std.reshape(3).repeat(224)
    kept = None   # the vsekit probe's float32 input buffer, kept between batches as Extractor._normalise does
    for x in DataLoader(PlainDataset(paths, crops), batch_size=BATCH, num_workers=1):
        b = x.shape[0]
        flat = x.reshape(-1, *x.shape[2:])
        t = time.thread_time()
        with torch.inference_mode():
            y = nchw((flat.float() - mean) / std).reshape(b, crops, -1).mean(1)
        model_s["nchw"] += time.thread_time() - t
        y.numpy().copy()
        t0 = time.thread_time()
        nhwc = flat.contiguous(memory_format=torch.channels_last)   # what vsekit's decoders deliver
        t = time.thread_time()
        with torch.inference_mode():
            y = cl(((nhwc.float() - mean) / std).contiguous(memory_format=torch.channels_last))
            y = y.reshape(b, crops, -1).mean(1)
        model_s["channels_last"] += time.thread_time() - t
        t = time.thread_time()   # normalised in place on NHWC rows, as vsekit does since issue 37
        with torch.inference_mode():
            z = nhwc.to(torch.float32, copy=True)
            z.permute(0, 2, 3, 1).reshape(-1, 224 * 3).sub_(rows_mean).div_(rows_std)
            y = cl(z).reshape(b, crops, -1).mean(1)
        model_s["channels_last_inplace"] += time.thread_time() - t
        t = time.thread_time()   # exactly vsekit's normalise + forward: the kept buffer, in place, channels-last
        with torch.inference_mode():
            if kept is None or kept.shape != nhwc.shape:
                kept = torch.empty_like(nhwc, dtype=torch.float32)   # channels-last, as nhwc
            z = kept.copy_(nhwc)
            z.permute(0, 2, 3, 1).reshape(-1, 224 * 3).sub_(rows_mean).div_(rows_std)
            y = cl(z.contiguous(memory_format=torch.channels_last)).reshape(b, crops, -1).mean(1)
        y.numpy().copy()
        model_s["channels_last_vsekit"] += time.thread_time() - t
        model_s["probe"] += time.thread_time() - t0   # the channels-last probes, conversion included
    return {"images": len(paths), "model_s": model_s}


def child_main(spec: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch  # noqa: F401  (imports first: their CPU varies by seconds on a loaded machine)
    import torchvision.transforms.v2.functional  # noqa: F401
    import vsekit.extract  # noqa: F401
    from vsekit.extract import extractor, reader, rows, runner  # noqa: F401

    self0, children0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    if spec["leg"] == "plain":
        out = leg_plain(spec["folder"], spec["n"], spec["crops"])
    else:
        out = leg_vsekit(spec["store"], spec["crops"], spec["decoder"], spec["channels_last"])
    out["self_s"] = _cpu(resource.RUSAGE_SELF) - self0
    out["children_s"] = _cpu(resource.RUSAGE_CHILDREN) - children0
    print("RESULT " + json.dumps(out), flush=True)


def run_leg(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = spec.get("src") or str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import procs; "
            "procs.child_main(json.loads(sys.argv[2]))")
    p = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), json.dumps(spec)],
                       env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"leg {spec} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def steady(spec: dict, stores: dict[int, Path], folder: Path) -> dict:
    """One leg's steady state per image (ms): (240-image run - 48-image run) / 192."""
    got = {}
    for n in (SMALL, LARGE):
        s = dict(spec, n=n, store=str(stores[n]), folder=str(folder))
        got[n] = run_leg(s)
    d = LARGE - SMALL
    out = {"driving_ms": 1e3 * (got[LARGE]["self_s"] - got[SMALL]["self_s"]) / d,
           "worker_ms": 1e3 * (got[LARGE]["children_s"] - got[SMALL]["children_s"]) / d}
    if spec["leg"] == "plain":
        for k in ("nchw", "channels_last", "channels_last_inplace", "channels_last_vsekit", "probe"):
            out[f"model_{k}_ms"] = 1e3 * (got[LARGE]["model_s"][k] - got[SMALL]["model_s"][k]) / d
        # the plain driving process beyond its NCHW model (less the channels-last probe it also ran)
        out["driving_beyond_ms"] = out["driving_ms"] - out["model_nchw_ms"] - out.pop("model_probe_ms")
    return out


def measure(legs: dict[str, dict], rounds: int, root: Path) -> dict:
    """{leg name: {figure: [per round]}}; legs interleaved within each round."""
    stores = make_stores(root)
    res: dict[str, dict[str, list[float]]] = {k: {} for k in legs}
    for r in range(rounds):
        for name, spec in legs.items():
            for k, v in steady(spec, stores, root / "img").items():
                res[name].setdefault(k, []).append(v)
            print(f"round {r + 1}/{rounds} {name}: " +
                  ", ".join(f"{k} {v[-1]:.2f}" for k, v in res[name].items()), file=sys.stderr, flush=True)
    return res


def med(values: list[float]) -> float:
    return statistics.median(values)


def load() -> str:
    return "load average %.1f / %.1f / %.1f on %d cores" % (*os.getloadavg(), os.cpu_count() or 0)
