"""Benchmark: training batches/s read from a store vs the same data as an in-memory array.

Builds a store of ``--images`` random global features (``--dim`` float32, chunks of ~16 MB; default
COCO's 113,287 training images x 2,048, ResNet-152's pooled size) with five random 12-token captions
per image, then times full epochs of ``vsekit.train.data.PairStream`` (one caption per image, batch
128, chunk-aware shuffling over a window of 8 chunks, or with `--window-chunks 0` the window the
default memory budget gives: one global shuffle when the set fits) over the Zarr store and over
``FeatureSource.from_array`` of the same rows. The issue's bar: ratio >= 0.8.

Two stores: the default layout of a float32 vector set (raw chunks, read straight into the window
buffer) and the same data zstd-compressed (zarr's default codec), to show what decoding costs.

    python -P bench/loader.py [--images 113287] [--dim 2048] [--epochs 2] [--window-chunks 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from vsekit.storage.store import FeatureStore, write_array
from vsekit.train.data import FeatureSource, PairStream, Tokens


def build(path: Path, n: int, dim: int, seed: int = 0, compressors="auto") -> FeatureStore:
    rng = np.random.default_rng(seed)
    store = FeatureStore.create(path, dataset="bench")
    store.write_images([str(i) for i in range(n)], [f"{i}.jpg" for i in range(n)], ["train"] * n)
    caps = np.repeat(np.arange(n), 5)
    store.write_captions(["x"] * len(caps), caps)
    g = store.root.require_group("tokens")
    lengths = np.full(len(caps), 12)
    write_array(g, "ids", rng.integers(4, 1000, size=int(lengths.sum())).astype(np.int32))
    write_array(g, "offsets", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    g.attrs["vocabulary"] = [str(i) for i in range(1000)]
    fs = store.create_features("f", (dim,), "float32", attrs={"kind": "global"}, compressors=compressors)
    for b in fs.blocks():
        fs.write_block(b, rng.normal(size=(len(b), dim)).astype(np.float32))
    return store


def rate(stream: PairStream, epochs: int, step=None) -> float:
    best = 0.0
    for e in range(epochs):
        t0 = time.perf_counter()
        n = 0
        for batch in stream.epoch(e):
            if step is not None:
                step(batch)
            n += 1
        best = max(best, n / (time.perf_counter() - t0))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=113287)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--window-chunks", type=int, default=8,
                    help="chunks per shuffle window; 0: sized by the default memory budget (a global "
                         "shuffle when the set fits it)")
    args = ap.parse_args()
    import torch
    from zarr.codecs import ZstdCodec

    torch.set_num_threads(1)
    fc = torch.nn.Linear(args.dim, 1024, bias=False)

    def step(batch):  # the image side of a training step: linear map, backward
        fc(batch.feats).square().mean().backward()

    kw = dict(batch_size=128, captions="one", window_chunks=args.window_chunks or None, seed=0)
    rows_out = []
    for codec, compressors in (("raw (default)", "auto"), ("zstd", [ZstdCodec(level=0)])):
        with tempfile.TemporaryDirectory() as tmp:
            store = build(Path(tmp) / "b.zarr", args.images, args.dim, compressors=compressors)
            tokens = Tokens.from_store(store)
            rows = store.split_rows("train")
            src = FeatureSource(store.features("f"))
            mem = FeatureSource.from_array(np.asarray(src._data[:]), chunk_rows=src.chunk_rows)
            consumers = (("loader only", None), ("with a linear-encoder step", step))
            for label, fn in consumers if codec.startswith("raw") else consumers[:1]:
                r_store = rate(PairStream(src, tokens, rows, store.caption_images(), **kw), args.epochs, fn)
                r_mem = rate(PairStream(mem, tokens, rows, store.caption_images(), **kw), args.epochs, fn)
                rows_out.append((codec, label, r_store, r_mem))
            del mem
    window = args.window_chunks or "budget"
    print("| images x dim | chunk rows | window | codec | consumer | store batches/s | in-memory batches/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for codec, label, r_store, r_mem in rows_out:
        print(f"| {args.images} x {args.dim} float32 | {src.chunk_rows} | {window} | {codec} | {label} | "
              f"{r_store:.1f} | {r_mem:.1f} | {r_store / r_mem:.2f} |")


if __name__ == "__main__":
    main()
