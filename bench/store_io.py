"""Ingest / export throughput and peak memory of the store's streaming paths.

Each measurement runs in a fresh child process (so its peak RSS is its own) and is reported as a
ratio against a minimal single-purpose baseline doing the same bytes in the same run:

* BUTD ingest (``ingest_butd``: check pass + chunk-aligned write pass into Zarr, float16) vs. a
  one-pass loop that base64-decodes each line into a float16 ``np.memmap``;
* ``export scan`` (store → ``{split}_ims.npy``) vs. ``np.save`` of the same array held in memory;
* ``export hdf5`` (chunked, gzip 4) vs. ``h5py`` writing the same in-memory array with the same
  chunking and compression.

Usage: ``python bench/store_io.py [--images 600] [--boxes 36] [--dim 2048]`` (default size: 600
images x 36 x 2048 float32 = 177 MB of features, a 236 MB TSV). Results go to stdout as a Markdown
table; the figures in bench/results/store.md come from the default run.
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing as mp
import queue
import resource
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_tsv(path: Path, n: int, k: int, d: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            boxes = rng.uniform(0, 500, size=(k, 4)).astype("<f4")
            feats = rng.random((k, d), dtype=np.float32)
            f.write(f"{i}\t640\t480\t{k}\t{base64.b64encode(boxes.tobytes()).decode()}\t"
                    f"{base64.b64encode(feats.tobytes()).decode()}\n")


def _baseline_butd(tsv: str, out: str, n: int, k: int, d: int, q) -> None:
    t = time.perf_counter()
    mm = np.lib.format.open_memmap(out, mode="w+", dtype=np.float16, shape=(n, k, d))
    with open(tsv, "rb") as f:
        for i, line in enumerate(f):
            parts = line.rstrip(b"\n").split(b"\t")
            mm[i] = np.frombuffer(base64.b64decode(parts[5]), dtype="<f4").reshape(k, d)
    mm.flush()
    q.put((time.perf_counter() - t, _peak_mb()))


def _vsekit_butd(tsv: str, store: str, n: int, q) -> None:
    from vsekit.storage import FeatureStore, ingest_butd

    with FeatureStore.building(store, dataset="bench") as s:  # images + captions to attach to
        s.write_images([str(i) for i in range(n)], [""] * n, ["train"] * (n - n // 5) + ["test"] * (n // 5))
        s.write_captions([f"caption {j}" for j in range(5 * n)], np.arange(5 * n) // 5)
    t = time.perf_counter()
    ingest_butd([tsv], store)  # into the existing store, matched by image id
    q.put((time.perf_counter() - t, _peak_mb()))


def _baseline_npy(src: str, out: str, q) -> None:
    arr = np.load(src)  # the baseline holds the whole array in memory
    t = time.perf_counter()
    np.save(out, arr)
    q.put((time.perf_counter() - t, _peak_mb()))


def _vsekit_scan(store: str, out: str, q) -> None:
    from vsekit.storage.interop import export_precomp

    t = time.perf_counter()
    export_precomp(store, "regions", out, layout="scan")
    q.put((time.perf_counter() - t, _peak_mb()))


def _baseline_h5(src: str, out: str, chunk_rows: int, q) -> None:
    import h5py

    arr = np.load(src)
    t = time.perf_counter()
    with h5py.File(out, "w") as h5:
        h5.create_dataset("data", data=arr, chunks=(chunk_rows, *arr.shape[1:]), compression="gzip",
                          compression_opts=4, shuffle=True)
    q.put((time.perf_counter() - t, _peak_mb()))


def _vsekit_h5(store: str, out: str, q) -> None:
    from vsekit.storage.interop import export_hdf5

    t = time.perf_counter()
    export_hdf5(store, out)
    q.put((time.perf_counter() - t, _peak_mb()))


def _run(target, *args) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    while True:  # poll, so a child that dies does not leave us waiting
        try:
            result = q.get(timeout=1)
            break
        except queue.Empty:
            if not p.is_alive():
                raise SystemExit(f"{target.__name__} failed (exit code {p.exitcode}); see its traceback above")
    p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--boxes", type=int, default=36)
    ap.add_argument("--dim", type=int, default=2048)
    args = ap.parse_args()
    n, k, d = args.images, args.boxes, args.dim
    tmp = Path(tempfile.mkdtemp(prefix="vsekit-bench-"))
    try:
        tsv = tmp / "f.tsv"
        _write_tsv(tsv, n, k, d)
        mb = n * k * d * 4 / 1e6
        rows = []
        t0, m0 = _run(_baseline_butd, str(tsv), str(tmp / "base.npy"), n, k, d)
        t1, m1 = _run(_vsekit_butd, str(tsv), str(tmp / "s.zarr"), n)
        rows.append(("BUTD ingest (TSV → float16)", "memmap one-pass decode", t0, m0, t1, m1))
        from vsekit.storage import FeatureStore

        chunk_rows = FeatureStore.open(tmp / "s.zarr").features("regions").chunk_rows
        t0, m0 = _run(_baseline_npy, str(tmp / "base.npy"), str(tmp / "copy.npy"))
        t1, m1 = _run(_vsekit_scan, str(tmp / "s.zarr"), str(tmp / "scan"))
        rows.append(("export scan (→ .npy)", "np.save of in-memory array", t0, m0, t1, m1))
        h5_rows = max(1, (1 << 20) // (k * d * 2))
        t0, m0 = _run(_baseline_h5, str(tmp / "base.npy"), str(tmp / "base.h5"), h5_rows)
        t1, m1 = _run(_vsekit_h5, str(tmp / "s.zarr"), str(tmp / "s.h5"))
        rows.append(("export hdf5 (gzip 4)", "h5py write of in-memory array", t0, m0, t1, m1))
        print(f"{n} images x {k} boxes x {d} (float32 source {mb:.0f} MB; TSV "
              f"{tsv.stat().st_size / 1e6:.0f} MB; store chunk {chunk_rows} rows)\n")
        print("| operation | baseline | baseline s | vsekit s | ratio | baseline peak RSS MB | vsekit peak RSS MB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, base, t0, m0, t1, m1 in rows:
            print(f"| {name} | {base} | {t0:.2f} | {t1:.2f} | {t1 / t0:.2f}x | {m0:.0f} | {m1:.0f} |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
