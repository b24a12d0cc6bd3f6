"""Benchmark: FNE standardize + discretize throughput against a plain Zarr copy, peak RSS, stored sizes.

Builds a store with one float32 feature set of at least 2 GiB (default 131,072 rows x 4,096 features,
exactly 2 GiB uncompressed; zstd, the store's default codec), then times, each in its own child
process (so every peak RSS is that stage's own):

* ``copy``         a plain Zarr copy of the same array (read, write with the same codecs), dask threads;
* ``standardize``  -> ``feat.z`` (a statistics pass + a write pass);
* ``discretize``   ``feat.z`` -> ``feat.z.fne`` (int8);
* ``pack``         ``feat.z`` -> ``feat.z.fne2`` (2-bit packed, for the stored size);
* ``fne``          both stages fused (``vsekit fne``): ``feat`` -> ``feat.z`` + ``feat.z.fne``, written afresh.

The ratio is (copy time) / (stage time): 1.0 means as fast as copying the array once.
Usage: ``python bench/fne.py [--rows 131072] [--width 4096] [--dir DIR] [--out bench/results/fne.md]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0], and bench/tokenize.py would shadow the standard
# library's tokenize module (which inspect, and so dask, import).
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = Path(__file__).resolve().parent


def build(path: Path, rows: int, width: int) -> None:
    from vsekit.storage import FeatureStore

    store = FeatureStore.create(path, dataset="bench")
    splits = np.where(np.arange(rows) % 10 < 8, "train", np.where(np.arange(rows) % 10 == 8, "val", "test"))
    store.write_images([str(i) for i in range(rows)], [f"{i}.jpg" for i in range(rows)], list(splits))
    fs = store.create_features("feat", (width,), np.float32, attrs={"kind": "fne", "model": "bench"})
    scale = np.random.default_rng(0).uniform(0.1, 5.0, size=width).astype(np.float32)

    def write(block):
        rng = np.random.default_rng(block.index + 1)
        x = np.abs(rng.standard_normal((len(block), width), dtype=np.float32)) * scale
        fs.write_block(block, x)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(write, fs.blocks()))


def run_stage(stage: str, path: str) -> dict:
    """Run one stage in this (child) process; returns seconds and peak RSS."""
    import dask.array as da  # imported before the clock starts, for every stage alike
    import zarr

    from vsekit.fne import discretize, fne, standardize

    if stage == "fne":
        from vsekit.storage import FeatureStore

        st = FeatureStore.open(path, mode="r+")
        for name in ("feat.z.fne", "feat.z"):
            st.delete_features(name)
    use0 = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = use0.ru_utime + use0.ru_stime
    t0 = time.perf_counter()
    if stage == "copy":
        src = zarr.open_group(path, mode="r+", zarr_format=3)["features/feat/data"]
        dst = zarr.open_group(path, mode="r+", zarr_format=3).create_array(
            "plain_copy", shape=src.shape, dtype=src.dtype, chunks=src.chunks, compressors=src.compressors,
            overwrite=True)
        da.from_zarr(src).store(dst, lock=False, scheduler="threads")
    elif stage == "standardize":
        standardize(path, "feat")
    elif stage == "discretize":
        discretize(path, "feat.z")
    elif stage == "pack":
        discretize(path, "feat.z", pack=True, name="feat.z.fne2")
    elif stage == "fne":
        fne(path, "feat")
    else:
        raise ValueError(f"unknown stage {stage!r}")
    seconds = time.perf_counter() - t0
    use = resource.getrusage(resource.RUSAGE_SELF)
    return {"stage": stage, "seconds": seconds, "cpu_seconds": use.ru_utime + use.ru_stime - cpu0,
            "peak_rss_mb": use.ru_maxrss / 1024}


def child(stage: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--stage", stage, "--dir", str(path)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"stage {stage} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--dir", type=Path, default=None, help="Working folder (default: a temporary one).")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fne.md")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        print(json.dumps(run_stage(args.stage, str(args.dir))))
        return

    work = Path(tempfile.mkdtemp(prefix="vsekit-bench-fne-", dir=args.dir))
    try:
        store = work / "bench.zarr"
        t0 = time.perf_counter()
        build(store, args.rows, args.width)
        build_s = time.perf_counter() - t0
        raw = args.rows * args.width * 4
        results = {s: child(s, store) for s in ("copy", "standardize", "discretize", "pack")}
        sizes = {label: du(store / "features" / name / "data") for label, name in
                 (("float32 (feat)", "feat"), ("float32 (feat.z)", "feat.z"),
                  ("int8 (feat.z.fne)", "feat.z.fne"), ("packed 2-bit (feat.z.fne2)", "feat.z.fne2"))}
        results["fne"] = child("fne", store)  # deletes feat.z and feat.z.fne first, untimed
        report(args, raw, build_s, results, sizes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(args, raw: int, build_s: float, results: dict, sizes: dict) -> None:
    copy = results["copy"]["seconds"]
    gib = raw / 2**30
    lines = [
        "# FNE post-processing benchmark (`bench/fne.py`)", "",
        f"Command: `.venv/bin/python bench/fne.py --rows {args.rows} --width {args.width}`  ",
        f"Store: {args.rows:,} rows x {args.width:,} float32 features = {gib:.2f} GiB uncompressed "
        f"(zstd, the store's default codec; chunks of {16} MiB); built in {build_s:.0f} s.  ",
        f"Machine: {os.cpu_count()} CPU cores, **shared with other engineers' test runs** while measured, "
        "so absolute figures are noisy; the ratios compare runs made back to back. Each stage runs in "
        "its own process, in-process dask threads (no --cluster).", "",
        "| stage | seconds | GiB/s of input | ratio vs plain copy | CPU seconds | CPU ratio vs copy | peak RSS (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    cpu = results["copy"]["cpu_seconds"]
    for stage in ("copy", "standardize", "discretize", "pack", "fne"):
        r = results[stage]
        lines.append(f"| {stage} | {r['seconds']:.1f} | {gib / r['seconds']:.2f} | "
                     f"{copy / r['seconds']:.2f} | {r['cpu_seconds']:.1f} | {cpu / r['cpu_seconds']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    both = results["standardize"]["seconds"] + results["discretize"]["seconds"]
    both_cpu = results["standardize"]["cpu_seconds"] + results["discretize"]["cpu_seconds"]
    lines += [
        f"| standardize + discretize (two commands) | {both:.1f} | {gib / both:.2f} | {copy / both:.2f} | "
        f"{both_cpu:.1f} | {cpu / both_cpu:.2f} | "
        f"{max(results['standardize']['peak_rss_mb'], results['discretize']['peak_rss_mb']):.0f} |",
        "", "Stored size of the `data` array (on disk, compressed):", "",
        "| representation | bytes | vs float32 |", "| --- | ---: | ---: |",
    ]
    base = sizes["float32 (feat.z)"]
    for label, size in sizes.items():
        lines.append(f"| {label} | {size:,} | {size / base:.3f} |")
    lines += ["", "Targets (issue #4): ratio >= 0.5 for standardize + discretize; peak RSS < 1 GiB."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
