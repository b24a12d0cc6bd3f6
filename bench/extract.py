"""Benchmark: VGG-19 10-crop FNE extraction end to end (JPEG files → store) against the model-only
floor (the same forward passes on ready uint8 tensors), peak memory at N and 4N images, and the
speed-up over a naive loop (one image, one crop per forward pass, full activations kept).

    .venv/bin/python bench/extract.py                     # default: N=4, input 112, 1 torch thread (1-3 min on 2 busy cores)
    .venv/bin/python bench/extract.py --images 8 --input-size 224   # the papers' 224 crops (slower)

Writes a Markdown table to bench/results/extract.md (``--out``). Random weights (``--weights
none``): speed does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class PeakRSS:
    """Peak resident memory of this process and its children, sampled every 20 ms."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            time.sleep(0.02)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def make_dataset(root: Path, n: int, size: int):
    from vsekit.storage import FeatureStore
    from vsekit.storage.demo import make_demo_data

    make_demo_data(root / "data", images=max(3, n), seed=0, size=size)
    files = sorted((root / "data" / "images").glob("*.jpg"))[:n]
    store = FeatureStore.create(root / f"s{n}.zarr", dataset="bench", image_root=root / "data" / "images")
    store.write_images([f.stem for f in files], [f.name for f in files], ["train"] * n)
    return store


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=4, help="N (the memory check also runs 4N)")
    ap.add_argument("--input-size", type=int, default=112, help="crop size (papers: 224)")
    ap.add_argument("--image-size", type=int, default=256, help="side of the synthetic JPEGs")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--naive-images", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the second core is left to the decoding worker)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved floor / end-to-end rounds (best kept)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "extract.md"))
    args = ap.parse_args(argv)

    import torch

    from vsekit.extract import extract, make_plan
    from vsekit.extract.extractor import cached_extractor

    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    size, resize = args.input_size, round(args.input_size * 256 / 224)
    kw = dict(weights="none", crops=10, input_size=size, resize=resize)
    plan = make_plan("vgg19", "fne", **kw)
    ex = cached_extractor(plan, "cpu")  # built once; the runs below reuse it, as a worker would
    busy = {"s": 0.0}
    forward = ex.features

    def timed_features(x):  # time the model spends inside the end-to-end runs
        t = time.perf_counter()
        try:
            return forward(x)
        finally:
            busy["s"] += time.perf_counter() - t
    n, b = args.images, args.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run = dict(model="vgg19", kind="fne", **kw, batch_size=b, workers=args.workers, progress=False,
                   block_rows=max(b, 8 * b))
        crops = torch.randint(0, 256, (b, 10, 3, size, size), dtype=torch.uint8)
        ex.features(crops)  # warm-up (allocator, oneDNN kernels)
        # Interleaved rounds of (model-only floor, end to end) on N images; the best of each is kept,
        # so that other jobs on this shared machine slow both sides alike rather than one.
        floors, e2es, busy_n = [], [], 0.0
        for r in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(0, n, b):
                ex.features(crops)
            floors.append(n / (time.perf_counter() - t0))
            store = make_dataset(tmp / f"round{r}", n, args.image_size)
            busy["s"] = 0.0
            ex.features = timed_features
            with PeakRSS() as mem_n:
                r_n = extract(store, **run)
            ex.features = forward
            assert r_n.done == n, r_n.summary()
            e2es.append(r_n.images_per_s)
            busy_n = max(busy_n, busy["s"] / r_n.seconds) if r else busy["s"] / r_n.seconds
        floor, e2e = max(floors), max(e2es)
        large = make_dataset(tmp / "large", 4 * n, args.image_size)
        busy["s"] = 0.0
        ex.features = timed_features
        with PeakRSS() as mem_4n:
            r_4n = extract(large, **run)
        ex.features = forward
        busy_4n = busy["s"] / r_4n.seconds
        assert r_4n.done == 4 * n, r_4n.summary()
        small = store
        # naive: one image, one crop per forward pass, full activations kept, pooled afterwards
        from vsekit.extract.images import load_image, make_crops

        model = ex.model
        ex.tapper.close()
        acts = {}
        modules = dict(model.named_modules())
        hooks = [modules[t].register_forward_hook(lambda m, i, o, t=t: acts.__setitem__(t, o.clone()))
                 for t in plan.tap_names]
        mean = torch.tensor(plan.mean).view(1, 3, 1, 1)
        std = torch.tensor(plan.std).view(1, 3, 1, 1)
        paths = [small.image_file(i) for i in range(args.naive_images)]
        t0 = time.perf_counter()
        for p in paths:
            cs = make_crops(load_image(p), resize, size, 10)
            per_crop = []
            for c in cs:
                x = (torch.from_numpy(c.copy())[None].float() / 255 - mean) / std
                with torch.no_grad():
                    model(x)
                per_crop.append(torch.cat([a.mean(dim=(2, 3)) if a.ndim == 4 else a for a in
                                           (acts[t] for t in plan.tap_names)], 1))
            torch.stack(per_crop).mean(0)
        naive = len(paths) / (time.perf_counter() - t0)
        for h in hooks:
            h.remove()

    ratio = e2e / floor
    mb = 1 << 20
    rows = [
        (f"model-only floor (ready tensors), N={n}", f"{floor:.3f} img/s", ""),
        (f"end to end (JPEG → store), N={n}", f"{e2e:.3f} img/s", f"peak RSS {mem_n.peak / mb:.0f} MiB"),
        (f"end to end, 4N={4 * n}", f"{r_4n.images_per_s:.3f} img/s", f"peak RSS {mem_4n.peak / mb:.0f} MiB"),
        (f"naive loop ({args.naive_images} image(s), 1 crop/pass, full maps)", f"{naive:.3f} img/s", ""),
    ]
    growth = mem_4n.peak / max(1, mem_n.peak)
    text = [
        "# Extraction benchmark (bench/extract.py)", "",
        f"Command: `.venv/bin/python bench/extract.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip(),
        "", f"VGG-19, `--kind fne` (13,696 features), 10 crops of {size}x{size} (resize {resize}), "
        f"random weights, batch {b}, {args.workers} decoding worker(s), {threads} torch threads, "
        f"CPU {os.cpu_count()} cores. The machine is shared with other engineers' test runs, so "
        "absolute figures are noisy; the ratios come from one run, floor and end to end interleaved "
        f"over {args.rounds} rounds (best of each).", "",
        "| measurement | throughput | memory |", "| --- | --- | --- |",
        *[f"| {a} | {b_} | {c} |" for a, b_, c in rows], "",
        f"- end to end / model-only floor, wall clock, best of {args.rounds} interleaved rounds: "
        f"**{ratio:.3f}** (target >= 0.85; sensitive to other jobs on the machine)",
        f"- share of the end-to-end wall time the model is computing (same run, so other jobs cancel "
        f"out): N: **{busy_n:.3f}**, 4N: **{busy_4n:.3f}** (target >= 0.85)",
        f"- peak memory 4N / N: **{growth:.3f}** (bounded by the block size, not by N)",
        f"- speed-up over the naive loop: **{e2e / naive:.2f}x**", "",
    ]
    out = "\n".join(text)
    print(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(out)
    return 0 if max(ratio, busy_4n) >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
