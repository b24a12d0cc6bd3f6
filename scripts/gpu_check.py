"""`make gpu-check`: every CUDA path of vsekit, checked the first time a GPU is at hand.

    python scripts/gpu_check.py                       # on a GPU machine: all checks (< 10 minutes on an H100)
    python scripts/gpu_check.py --wheels WHEELDIR     # first install vsekit's dependencies from built wheels
    python scripts/gpu_check.py --cpu --small         # CPU mode (CI, tests/test_gpu_check.py): tiny sizes

Each check appends one JSON line to the results file (``--out``, default
``bench/results/gpu_check-<UTC time>.jsonl``) as soon as it is measured: ``{"check", "ok", ...figures}``;
a check that fails records its error and the next one runs. Exit status 1 if any check failed.

Checks (``--only`` / ``--skip`` take their names): probe (driver, torch/CUDA, torchvision ops on the
device, libjpeg-turbo vs PIL pixels), install (``--wheels``), demo (extraction on the device vs the
CPU: float32 within 1e-4 relative, stored float16 within 2e-3; the trainer's first-epoch loss),
throughput (10-crop VGG-19 from 640x480 JPEGs: model-only floor vs end to end in fp32/bf16/fp16, its
warm-up and steady state apart, with the CPU decoder and ``--decoder nvjpeg``, whose features are held
to ``gpu_decode.TOLERANCE`` of the CPU decoder's; peak device and host memory), detectors (coco-frcnn and butd-r101 on the device vs the CPU), sgraf (SAF scoring on the
device vs the CPU), cluster (``extract --cluster local:2 --device cuda`` vs in-process), train_step
(helper hook: ``bench/train_step.py``'s ``gpu_check(device, small)`` if it exists), train_compare
(SAF / SGR / VSE++ training steps against the references' own formulation on the same device:
speed-up, peak memory, share of the matmul floor, fp32 and bf16), train_precision (``vsekit train
--precision bf16`` against fp32: speed-up, loss within 3%), ddp (one epoch of
``vsekit train --nproc-per-node 1`` on the device: a one-rank NCCL group, every collective of the
data-parallel step run; its loss and weights against the same epoch in one process; gloo in ``--cpu``).

In ``--cpu`` mode the "device" is the CPU: each device-vs-CPU comparison becomes a CPU-vs-CPU
sanity check, and fp16 (CUDA only) is skipped. Only vsekit's public CLI and library calls are used.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("install", "probe", "demo", "throughput", "detectors", "sgraf", "cluster", "train_step", "train_compare",
          "train_precision", "ddp")


class Results:
    """Appends one JSON line per figure set, flushed at once (a run cut short keeps what it measured)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.failed = 0

    def add(self, check: str, ok: bool | None, **fields):
        rec = {"check": check, "ok": ok, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        if ok is False:
            self.failed += 1
        flag = {True: "ok", False: "FAIL", None: "skip"}[ok]
        short = {k: v for k, v in fields.items() if k not in ("traceback",)}
        print(f"[gpu-check] {check}: {flag} {json.dumps(short, default=str)[:400]}", flush=True)


def vsekit(*args: str) -> None:
    """One vsekit CLI command, in-process (the public CLI; no interpreter start per command)."""
    from vsekit.cli import main

    try:
        main(list(args), standalone_mode=False)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise RuntimeError(f"vsekit {' '.join(args)} exited {exc.code}") from None


class PeakRSS:
    """Peak resident memory of this process and its children, sampled every 20 ms."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            total = 0
            for p in [self.proc, *self.proc.children(recursive=True)]:
                with contextlib.suppress(Exception):
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)
            time.sleep(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def rel_err(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def features(store: Path, name: str):
    import numpy as np

    from vsekit.storage import FeatureStore

    return np.asarray(FeatureStore.open(store).features(name).data[:], np.float32)


class Ctx:
    def __init__(self, args, work: Path, res: Results):
        self.args, self.work, self.res = args, work, res
        self.device = "cpu" if args.cpu else args.device
        self.small = args.small
        self.model = "test_resnet" if args.small else "vgg19"   # timm's tiny test ResNet: seconds on a CPU
        self._demo = None
        self._tiny = None
        self.site: Path | None = None   # where check_install put the wheels

    def demo_store(self) -> Path:
        """A small demo dataset ingested once (the demo's own synthetic images)."""
        if self._demo is None:
            d = self.work / "demo"
            vsekit("demo-data", str(d / "data"), "--images", "24" if self.small else "200", "--size", "64" if self.small else "128")
            vsekit("ingest", "karpathy", str(d / "data" / "dataset_demo.json"), "--image-root", str(d / "data"),
                   "--store", str(d / "demo.zarr"))
            vsekit("tokenize", "--store", str(d / "demo.zarr"), "--min-count", "1")
            self._demo = d / "demo.zarr"
        return self._demo

    def tiny_store(self) -> Path:
        """Three demo images (detectors at their own ~800-pixel input are slow on a CPU)."""
        if self._tiny is None:
            d = self.work / "tiny"
            vsekit("demo-data", str(d / "data"), "--images", "3", "--size", "128")
            vsekit("ingest", "karpathy", str(d / "data" / "dataset_demo.json"), "--image-root", str(d / "data"),
                   "--store", str(d / "tiny.zarr"))
            self._tiny = d / "tiny.zarr"
        return self._tiny


# --- checks ------------------------------------------------------------------------------------------------
def check_probe(ctx: Ctx):
    import numpy as np
    import torch
    import torchvision

    out = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "torchvision": torchvision.__version__,
           "cuda_available": torch.cuda.is_available(), "device": ctx.device, "python": sys.version.split()[0]}
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        out["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    dev = torch.device(ctx.device)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        out.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                   bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())
    from torchvision.ops import nms, roi_align

    g = torch.Generator().manual_seed(0)
    xy = torch.rand(200, 2, generator=g) * 100
    boxes = torch.cat([xy, xy + torch.rand(200, 2, generator=g) * 50 + 1], 1)
    scores = torch.rand(200, generator=g)
    keep_cpu, keep_dev = nms(boxes, scores, 0.5), nms(boxes.to(dev), scores.to(dev), 0.5).cpu()
    fmap = torch.randn(2, 8, 32, 32, generator=g)
    rois = torch.tensor([[0, 1.0, 2.0, 20.0, 25.0], [1, 0.0, 0.0, 31.0, 31.0]])
    ra_cpu = roi_align(fmap, rois, (7, 7), 0.5, 2, True)
    ra_dev = roi_align(fmap.to(dev), rois.to(dev), (7, 7), 0.5, 2, True).cpu()
    out.update(nms_equal=bool(torch.equal(keep_cpu, keep_dev)), roi_align_rel_err=rel_err(ra_dev, ra_cpu))
    # the "pil" decoder's claim: libjpeg-turbo through torchvision decodes to PIL's pixels
    from PIL import Image

    from vsekit.extract import images
    from vsekit.extract.images import load_image

    rng = np.random.default_rng(0)
    img = np.clip(rng.normal(128, 40, (120, 160, 3)), 0, 255).astype(np.uint8)
    p = ctx.work / "probe.jpg"
    Image.fromarray(img).save(p, quality=90)
    dec = images._decode(p, "pil", None, "shorter", True)[0]   # the full-size decode extraction starts with
    out["decode_jpeg_equals_pil"] = bool(isinstance(dec, np.ndarray) and np.array_equal(dec, np.asarray(load_image(p))))
    ok = out["nms_equal"] and out["roi_align_rel_err"] < 1e-4 and out["decode_jpeg_equals_pil"]
    if ctx.device.startswith("cuda") and not out["cuda_available"]:
        ok = False
    return ok, out


def check_install(ctx: Ctx):
    """Install the wheels (not vsekit's own: this checkout's sources are what is checked) into a site
    folder and check that a fresh interpreter imports vsekit from ``src/`` with them. ``main`` then
    runs the other checks in a fresh interpreter with that path: adding a site folder to a running
    interpreter left ``distributed`` unimportable on the H100 (2026-11-27)."""
    if not ctx.args.wheels:
        return None, {"why": "no --wheels folder given (the environment is already installed)"}
    wheels = [w for w in sorted(Path(ctx.args.wheels).glob("*.whl")) if not w.name.startswith("vsekit-")]
    target = ctx.work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--target", str(target), *map(str, wheels)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return False, {"pip": r.stderr[-2000:]}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(target)])}
    probe = ("import vsekit, vsekit.cli, zarr, dask.distributed, distributed, nltk; "
             "print(zarr.__version__, distributed.__version__, vsekit.__file__)")
    r2 = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    ok = r2.returncode == 0 and str(ROOT / "src") in r2.stdout
    if ok:
        ctx.site = target
    return ok, {"wheels": len(wheels), "site": str(target), "import": (r2.stdout or r2.stderr).strip()[-1000:]}


def check_demo(ctx: Ctx):
    store = ctx.demo_store()
    size = ["--resize", "32", "--input-size", "32"]
    common = ["--store", str(store), "--model", ctx.model, "--weights", "none", "--workers", "0", "--no-progress",
              "--batch-size", "8", *size]
    out, ok = {}, True
    for kind in ("global", "fne"):
        for dtype, tol in (("float32", 1e-4), ("float16", 2e-3)):
            a, b = f"cpu_{kind}_{dtype}", f"dev_{kind}_{dtype}"
            vsekit("extract", *common, "--kind", kind, "--dtype", dtype, "--name", a, "--device", "cpu")
            vsekit("extract", *common, "--kind", kind, "--dtype", dtype, "--name", b, "--device", ctx.device)
            e = rel_err(features(store, b), features(store, a))
            out[f"{kind}_{dtype}_rel_err"] = e
            ok &= e <= tol
    losses = {}
    for dev in ("cpu", ctx.device):
        run = ctx.work / f"run-{dev.replace(':', '')}-{len(losses)}"
        vsekit("train", "--store", str(store), "--features", "cpu_global_float32", "--preset", "seam-e",
               "--preset", "demo", "--epochs", "1", "--out", str(run), "--device", dev, "--no-progress", "--seed", "0")
        hist = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        losses[dev + str(len(losses))] = next(h["loss"] for h in hist if h.get("loss") is not None)
    la, lb = list(losses.values())
    out["train_first_epoch_loss"] = losses
    out["train_loss_rel_diff"] = abs(la - lb) / max(abs(la), 1e-12)
    ok &= out["train_loss_rel_diff"] < 1e-3
    return ok, out


def photo_store(ctx: Ctx, n: int) -> Path:
    """A store of ``n`` 640x480 photo-like JPEGs (bench/procs.py's), through the demo's dataset files."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from procs import make_photos
    finally:
        sys.path.pop(0)
    from concurrent.futures import ThreadPoolExecutor

    d = ctx.work / f"photos{n}"
    vsekit("demo-data", str(d / "data"), "--images", str(n), "--size", "16")
    imgs = sorted((d / "data" / "images").glob("*.jpg"))
    parts = max(1, min(os.cpu_count() or 1, len(imgs) // 64))   # 4,500 JPEGs: a minute on one core
    # threads: numpy's noise and PIL's encoder release the GIL for most of an image
    cut = [len(imgs) * k // parts for k in range(parts + 1)]
    with ThreadPoolExecutor(parts) as pool:
        made = pool.map(make_photos, [d / f"gen{k}" for k in range(parts)],
                        [cut[k + 1] - cut[k] for k in range(parts)], [640] * parts, [480] * parts, range(parts))
        srcs = [p for chunk in made for p in chunk]
    for src, dst in zip(srcs, imgs):
        src.replace(dst)
    vsekit("ingest", "karpathy", str(d / "data" / "dataset_demo.json"), "--image-root", str(d / "data"),
           "--store", str(d / "s.zarr"))
    return d / "s.zarr"


class BatchClock:
    """When each batch's features were back in the driving process (``Extractor.features`` returns
    them on the host, so on CUDA the time is after the device finished): warm-up and steady state
    apart, from one run."""

    def __init__(self):
        from vsekit.extract.extractor import Extractor

        self.cls, self.real, self.marks = Extractor, Extractor.features, []

    def __enter__(self):
        clock, real = self, self.real

        def timed(ex, crops):
            out = real(ex, crops)
            clock.marks.append((time.perf_counter(), int(crops.shape[0])))
            return out

        self.t0 = time.perf_counter()
        self.cls.features = timed
        return self

    def __exit__(self, *exc):
        self.cls.features = self.real

    def split(self, warm: int) -> dict:
        """Warm-up: from the call to the batch that completes ``warm`` images; steady state: the images
        after it over the time after it."""
        done, k = 0, 0
        while k < len(self.marks) and done < warm:
            done += self.marks[k][1]
            k += 1
        t_warm = self.marks[k - 1][0] if k else self.t0
        rest = sum(n for _, n in self.marks[k:])
        span = self.marks[-1][0] - t_warm if rest else 0.0
        return {"warmup_images": done, "warmup_s": round(t_warm - self.t0, 3), "steady_images": rest,
                "steady_s": round(span, 3), "steady_img_s": round(rest / span, 2) if span > 0 else None}


def check_throughput(ctx: Ctx):
    """10-crop VGG-19 from 640x480 JPEGs: the model-only floor, then end-to-end extraction with its
    warm-up and steady state apart (``--images`` in all, ``--warmup`` of them warm-up), for each
    precision, with the CPU decoder (the default) and with ``--decoder nvjpeg`` (whose features are
    held to ``gpu_decode.TOLERANCE`` of the CPU decoder's per image; in ``--cpu`` mode the batched
    path runs on the CPU and must equal it)."""
    import numpy as np
    import torch

    from vsekit.extract import build_model, extract, gpu_decode

    n = 8 if ctx.small else ctx.args.images
    warm = 4 if ctx.small else ctx.args.warmup
    size = 32 if ctx.small else 224
    resize = 36 if ctx.small else 256
    batch = 4 if ctx.small else 32
    store = photo_store(ctx, n)
    dev = torch.device(ctx.device)
    precisions = ["fp32", "bf16"] + (["fp16"] if dev.type == "cuda" else [])
    out, ok = {"images": n, "crops": 10, "input": size, "batch_images": batch}, True
    from vsekit.devices import exact_float32

    if dev.type != "cuda":   # CPU mode: nvjpeg's batched path on the CPU (refused there otherwise)
        gpu_decode.check_device = lambda device: None
    # the floor under extraction's own float32 (IEEE, no TF32): left to torch's defaults, cuDNN ran the
    # fp32 convolutions in TF32 whenever no earlier check had turned it off (97.6 vs 441 img/s on an H100)
    exact_float32()
    model = build_model(ctx.model, "none", device=ctx.device).eval()
    x = torch.randint(0, 256, (batch * 10, 3, size, size), dtype=torch.uint8, device=dev)
    for prec in precisions:
        dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
        steps = max(1, min(n, 640) // batch)

        def fwd():
            with torch.inference_mode(), torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                model(x.float().div_(255).contiguous(memory_format=torch.channels_last))

        fwd()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fwd()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        floor = steps * batch / (time.perf_counter() - t0)
        workers = 0 if ctx.small else min(8, os.cpu_count() or 1)
        for decoder in ("torchvision", "nvjpeg") if prec != "fp16" else ("torchvision",):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            name = f"tp_{prec}_{decoder}"
            with PeakRSS() as rss, BatchClock() as clock:
                t0 = time.perf_counter()
                r = extract(store, ctx.model, "global", weights="none", crops=10, resize=resize, input_size=size,
                            batch_size=batch, workers=workers, device=ctx.device, precision=prec, name=name,
                            decoder=decoder, progress=False)
                wall = time.perf_counter() - t0
            e2e = r.done / wall
            phases = clock.split(warm)
            steady = phases["steady_img_s"]
            rec = {"precision": prec, "decoder": decoder, "floor_img_s": round(floor, 2), "e2e_img_s": round(e2e, 2),
                   "e2e_over_floor": round(e2e / floor, 3), **phases,
                   "steady_over_floor": round(steady / floor, 3) if steady else None,
                   "decoding_workers": workers, "peak_host_rss_mib": round(rss.peak / 2**20)}
            if dev.type == "cuda":
                rec["peak_device_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20)
            good = r.failed == 0 and r.done == n
            if decoder == "nvjpeg":   # against the CPU decoder's features of the same precision, per image
                a, b = (features(store, f"tp_{prec}_{d}").astype(np.float64) for d in ("torchvision", "nvjpeg"))
                rel = np.linalg.norm(b - a, axis=1) / np.maximum(np.linalg.norm(a, axis=1), 1e-30)
                rec["nvjpeg_rel_max"] = float(rel.max())
                good &= bool(rel.max() <= (gpu_decode.TOLERANCE if dev.type == "cuda" else 0.0))
            ctx.res.add(f"throughput.{prec}.{decoder}", good, **rec)
            ok &= good
            out[f"{prec}.{decoder}"] = rec
    return ok, {"summary": {k: v["steady_over_floor"] for k, v in out.items() if isinstance(v, dict)}}


def check_detectors(ctx: Ctx):
    if ctx.small and ctx.device == "cpu" and "detectors" not in ctx.args.only.split(","):
        return None, {"why": "the detectors at their own ~800-pixel input take minutes on a CPU (384 s for "
                             "3 images on 2 loaded cores); `--cpu --small --only detectors` runs them"}
    store = ctx.tiny_store()
    out, ok = {}, True
    for det, extra in (("coco-frcnn", ["--detector-weights", "none", "--model", ctx.model, "--input-size", "64"]),
                       ("butd-r101", ["--detector-weights", "none", "--max-regions", "4"])):
        names = {}
        for dev in ("cpu", ctx.device) if ctx.device != "cpu" else ("cpu",):   # CPU mode: one run
            name = f"det_{det.replace('-', '_')}_{dev.replace(':', '')}_{len(names)}"
            vsekit("extract", "--store", str(store), "--kind", "regions", "--detector", det, *extra,
                   "--weights", "none", "--workers", "0", "--no-progress", "--batch-size", "4", "--dtype", "float32",
                   "--name", name, "--device", dev)
            names[dev + str(len(names))] = name
        a, b = (features(store, v) for v in [*names.values(), *names.values()][:2])
        e = rel_err(b, a)
        out[f"{det}_rel_err"] = e
        out[f"{det}_shape"] = list(a.shape)
        ok &= a.shape == b.shape and (e < 1e-2 if ctx.device != "cpu" else e == 0.0)
    return ok, out


def check_sgraf(ctx: Ctx):
    import numpy as np

    store = ctx.demo_store()
    vsekit("extract", "--store", str(store), "--model", ctx.model, "--kind", "regions", "--boxes",
           str(store.parent / "data" / "boxes.json"), "--max-regions", "3", "--min-regions", "1", "--input-size", "64",
           "--weights", "none", "--workers", "0", "--no-progress", "--name", "sg_regions", "--device", "cpu")
    run = ctx.work / "run-saf"
    vsekit("train", "--store", str(store), "--features", "sg_regions", "--model", "saf", "--preset", "saf-coco",
           "--preset", "sgraf-demo", "--epochs", "1", "--out", str(run), "--device", "cpu", "--no-progress")
    sims, metrics = {}, {}
    for dev in ("cpu", ctx.device):
        o = ctx.work / f"eval-{dev.replace(':', '')}-{len(sims)}"
        vsekit("evaluate", str(run), "--device", dev, "--out", str(o), "--save-sims", "--no-progress")
        f = sorted(o.glob("sims_*.npy"))[0]
        sims[dev + str(len(sims))] = np.load(f)
        metrics[dev + str(len(metrics))] = json.loads((o / "metrics.json").read_text())
    a, b = sims.values()
    e = rel_err(b, a)
    return bool(e < 1e-4), {"sims_shape": list(a.shape), "sims_rel_err": e}


def check_cluster(ctx: Ctx):
    from vsekit.extract import extract

    store = ctx.demo_store()
    kw = dict(weights="none", resize=36, input_size=32, batch_size=4, block_rows=8, workers=0, progress=False)
    extract(store, ctx.model, "global", name="cl_inproc", device=ctx.device, **kw)
    r = extract(store, ctx.model, "global", name="cl_local2", device=ctx.device, cluster="local:2", **kw)
    e = rel_err(features(store, "cl_local2"), features(store, "cl_inproc"))
    return r.failed == 0 and e <= 1e-6, {"rel_err_vs_in_process": e, "done": r.done}


def check_train_step(ctx: Ctx):
    path = ROOT / "bench" / "train_step.py"
    if not path.exists():
        return None, {"why": "bench/train_step.py not present"}
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, "gpu_check", None)
    if not callable(fn):
        return None, {"why": "bench/train_step.py has no gpu_check(device, small)"}
    got = fn(device=ctx.device, small=ctx.small)
    return bool(got.get("ok", True)), {k: v for k, v in got.items() if k != "ok"}


def _train_step_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_step", ROOT / "bench" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def matmul_rate(dev, dtype, n: int) -> float:
    """The device's matmul rate (FLOP/s) in ``dtype``: an n x n x n matmul, timed after a warm-up."""
    import torch

    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    reps = 3 if dev.type == "cpu" else 20
    a @ b
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm")


def matmul_flops(step) -> float:
    """The matmul FLOPs of one call of ``step`` (forward and backward), as torch's profiler counts them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, with_flops=True) as prof:
        step()
    return float(sum(e.flops or 0 for e in prof.events() if e.name in MATMUL_OPS))


def check_train_compare(ctx: Ctx):
    """Training steps on the device against the references' own formulation on the same device
    (``bench/train_step.py``: SAF and SGR against the SGRAF reference, VSE++ against vsepp's), batch
    128 at the papers' sizes (``--small``: batch 4, one step, bf16 through VSE++ only): seconds per step (synchronised, median
    after a warm-up), peak device memory, speed-up over the reference, and each step's share of the
    device's matmul floor (profiler-counted matmul FLOPs over the measured matmul rate), in fp32 and
    bf16 (autocast). Targets (issue 47) on a GPU: >= 1.5x for SAF/SGR, >= 1.0x for VSE++, at no more
    peak memory; the CPU mode only checks that every leg runs."""
    import statistics

    import torch

    mod = _train_step_module()
    dev = torch.device(ctx.device)
    cuda = dev.type == "cuda"
    batch, steps = (4, 1) if ctx.small else (128, 10)
    out, ok = {"batch": batch, "steps": steps}, True
    targets = {"saf": 1.5, "sgr": 1.5, "vse": 1.0}
    for prec in ("fp32", "bf16"):
        dtype = torch.bfloat16 if prec == "bf16" else torch.float32
        rate = matmul_rate(dev, dtype, 8192 if cuda else 256)
        out[f"matmul_rate_tflops_{prec}"] = round(rate / 1e12, 3)
        for ours, target in targets.items():
            if ctx.small and prec == "bf16" and ours != "vse":
                continue   # --small: bf16 through VSE++ only (SAF/SGR steps take seconds on a loaded CPU)
            rec = {}
            for name in (f"reference-{ours}", ours):
                step, _ = mod.make_step(name, batch, str(dev))

                def run(step=step):
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=prec == "bf16"):
                        return step()

                flops = matmul_flops(run)   # also the warm-up step
                sync(dev)
                if cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    loss = run()
                    sync(dev)
                    times.append(time.perf_counter() - t0)
                sec = statistics.median(times)
                rec[name] = {"s_per_step": round(sec, 5), "matmul_gflop": round(flops / 1e9, 2),
                             "matmul_floor_share": round(flops / sec / rate, 3),
                             "loss": float(loss.detach())}
                if cuda:
                    rec[name]["peak_device_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20)
                del step
            ref, mine = rec[f"reference-{ours}"], rec[ours]
            rec["speedup"] = round(ref["s_per_step"] / mine["s_per_step"], 3)
            good = all(v["loss"] == v["loss"] for v in (ref, mine))   # no NaN
            if cuda:
                rec["target"] = target
                good &= rec["speedup"] >= target and mine["peak_device_mib"] <= ref["peak_device_mib"]
            ctx.res.add(f"train_compare.{ours}.{prec}", good, **rec)
            ok &= good
            out[f"{ours}.{prec}"] = rec["speedup"]
    return ok, out


def check_train_precision(ctx: Ctx):
    """``vsekit train --precision bf16`` against fp32 on a short run (SAF on the demo's regions): the
    speed-up of the epoch and the epoch loss within 3% (docs/train.md, "Precision and host syncs")."""
    store = ctx.demo_store()
    from vsekit.storage import FeatureStore

    if "tp_regions" not in FeatureStore.open(store).feature_names():
        vsekit("extract", "--store", str(store), "--model", ctx.model, "--kind", "regions", "--boxes",
               str(store.parent / "data" / "boxes.json"), "--max-regions", "3", "--min-regions", "1",
               "--input-size", "64", "--weights", "none", "--workers", "0", "--no-progress", "--name", "tp_regions",
               "--device", ctx.device)
    got = {}
    for prec in ("fp32", "bf16"):
        run = ctx.work / f"prec-{prec}"
        t0 = time.perf_counter()
        vsekit("train", "--store", str(store), "--features", "tp_regions", "--model", "saf", "--preset", "saf-coco",
               "--preset", "sgraf-demo", "--epochs", "1" if ctx.small else "3", "--out", str(run), "--device",
               ctx.device, "--precision", prec, "--no-progress", "--seed", "0")
        hist = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        losses = [h["loss"] for h in hist if h.get("loss") is not None]
        got[prec] = {"seconds": round(time.perf_counter() - t0, 2), "loss": losses[-1]}
    rel = abs(got["bf16"]["loss"] - got["fp32"]["loss"]) / max(abs(got["fp32"]["loss"]), 1e-12)
    return bool(rel < 0.03), {"fp32": got["fp32"], "bf16": got["bf16"], "loss_rel_diff": round(rel, 5),
                             "speedup": round(got["fp32"]["seconds"] / got["bf16"]["seconds"], 3)}


def check_ddp(ctx: Ctx):
    """One epoch through ``--nproc-per-node 1`` (NCCL on CUDA, gloo on the CPU) vs one process."""
    import torch

    from vsekit.train.demo import pixel_features
    from vsekit.storage import FeatureStore

    store = ctx.demo_store()
    if "pixels" not in FeatureStore.open(store).feature_names():
        pixel_features(FeatureStore.open(store, mode="r+"), block_rows=32)
    runs = {}
    for mode, extra in (("single", []), ("group", ["--nproc-per-node", "1"])):
        run = ctx.work / f"ddp-{mode}"
        vsekit("train", "--store", str(store), "--features", "pixels", "--model", "vse", "--preset", "demo",
               "--epochs", "1", "--batch-size", "16", "--out", str(run), "--device", ctx.device, "--no-progress",
               "--seed", "0", *extra)
        hist = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs[mode] = (next(h["loss"] for h in hist if h.get("loss") is not None),
                      torch.load(run / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"])
    (la, wa), (lb, wb) = runs["single"], runs["group"]
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    rel = abs(la - lb) / max(abs(la), 1e-12)
    return rel < 1e-4 and diff < 1e-4, {"backend": "gloo" if ctx.device == "cpu" else "nccl",
                                        "loss_single": la, "loss_group": lb, "loss_rel_diff": rel,
                                        "weights_max_abs_diff": diff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="Every check on the CPU (CPU-vs-CPU sanity; CI).")
    ap.add_argument("--small", action="store_true", help="Tiny sizes (seconds per check).")
    ap.add_argument("--device", default="cuda", help="The device under test [default: cuda].")
    ap.add_argument("--images", type=int, default=4500, help="640x480 images of the throughput check.")
    ap.add_argument("--warmup", type=int, default=500,
                    help="the first images of each throughput run counted as warm-up, the rest as steady state.")
    ap.add_argument("--wheels", help="Folder of wheels (scripts/build_wheels.sh) to install first.")
    ap.add_argument("--out", help="Results file (JSON lines) [default: bench/results/gpu_check-<UTC>.jsonl].")
    ap.add_argument("--only", default="", help=f"Comma-separated checks: {','.join(CHECKS)}.")
    ap.add_argument("--skip", default="", help="Comma-separated checks to leave out.")
    ap.add_argument("--keep", action="store_true", help="Keep the work folder.")
    args = ap.parse_args(argv)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    res = Results(Path(args.out or ROOT / "bench" / "results" / f"gpu_check-{stamp}.jsonl"))
    only = [c for c in args.only.split(",") if c] or list(CHECKS)
    skip = {c for c in args.skip.split(",") if c}
    bad = [c for c in [*only, *skip] if c not in CHECKS]
    if bad:
        print(f"Error: --only/--skip {bad[0]!r}: checks are {', '.join(CHECKS)}", file=sys.stderr)
        return 1
    try:
        import vsekit  # noqa: F401
    except ImportError:   # a GPU machine without an install: this checkout's sources
        sys.path.insert(0, str(ROOT / "src"))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    import torch

    torch.manual_seed(0)
    if not args.cpu and not torch.cuda.is_available():
        print("Error: no CUDA device here (torch.cuda.is_available() is False); use --cpu for the CPU mode",
              file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="vsekit-gpu-check-"))
    print(f"[gpu-check] results -> {res.path}; work folder {work}", flush=True)
    ctx = Ctx(args, work, res)
    t_all = time.perf_counter()
    try:
        if "install" in only and "install" not in skip and args.wheels:
            t0 = time.perf_counter()
            ok, figures = check_install(ctx)
            res.add("install", ok, seconds=round(time.perf_counter() - t0, 2), **figures)
            if ok:   # the other checks in a fresh interpreter that sees src/ and the installed wheels
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [str(ROOT / "src"), str(ctx.site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
                rest, given = [], list(argv if argv is not None else sys.argv[1:])
                while given:   # the arguments less --wheels DIR / --wheels=DIR
                    a = given.pop(0)
                    if a == "--wheels":
                        given.pop(0)
                    elif not a.startswith("--wheels="):
                        rest.append(a)
                rest = [*rest, "--out", str(res.path), "--skip", ",".join(sorted(skip | {"install"}))]
                r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *rest], env=env)
                return r.returncode
            skip = skip | {"install"}
        for name in (c for c in CHECKS if c in only and c not in skip):
            t0 = time.perf_counter()
            try:
                ok, figures = globals()[f"check_{name}"](ctx)
            except Exception as exc:
                ok, figures = False, {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            res.add(name, ok, seconds=round(time.perf_counter() - t0, 2), **figures)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res.add("done", res.failed == 0, seconds=round(time.perf_counter() - t_all, 2), failed=res.failed)
    return 1 if res.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
