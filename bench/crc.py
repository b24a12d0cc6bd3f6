"""Benchmark: what checking the CRC-32 of every block ``train`` reads costs, next to a training step.

``train`` compares each chunk file it reads with the CRC-32 recorded when the block was written
(``vsekit.storage.integrity.BlockCheck``), so nothing trains on damaged data. This measures, in one
run on the same machine:

* the CRC-32 time per batch: ``zlib.crc32`` over the stored bytes of one batch's rows (each row is
  read, and checked, once per epoch), best of ``--repeat`` passes over the whole set;
* the loader's batches/s over the store with the check and without it (``PairStream``, one caption
  per image, batch 128, windows of 8 chunks, best of ``--epochs``); the check runs in the reader
  threads, one window ahead of the consumer;
* one training step of VSE++ at the paper's dimensions (joint 1024, word 300, GRU, hinge loss, Adam,
  batch 128, ``--device``), median of ``--steps``, and the image side alone (one linear map and its
  backward, the cheapest step any model makes);

and prints the ratio of the CRC time per batch to each step time.

    python -P bench/crc.py [--images 32768] [--dim 2048] [--device cpu|cuda] [--threads 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from vsekit.storage import integrity
from vsekit.storage.store import FeatureStore, write_array
from vsekit.train.data import FeatureSource, PairStream, Tokens

VOCAB = 10000


def build(path: Path, n: int, dim: int, seed: int = 0) -> FeatureStore:
    """``n`` images of random float32 ``dim``-vectors (raw chunks of ~16 MB), 5 12-token captions each."""
    rng = np.random.default_rng(seed)
    store = FeatureStore.create(path, dataset="bench")
    store.write_images([str(i) for i in range(n)], [f"{i}.jpg" for i in range(n)], ["train"] * n)
    caps = np.repeat(np.arange(n), 5)
    store.write_captions(["x"] * len(caps), caps)
    g = store.root.require_group("tokens")
    lengths = np.full(len(caps), 12)
    write_array(g, "ids", rng.integers(4, VOCAB, size=int(lengths.sum())).astype(np.int32))
    write_array(g, "offsets", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    g.attrs["vocabulary"] = [str(i) for i in range(VOCAB)]
    fs = store.create_features("f", (dim,), "float32", attrs={"kind": "global"})
    for b in fs.blocks():
        fs.write_block(b, rng.normal(size=(len(b), dim)).astype(np.float32))
    return store


def crc_seconds_per_byte(store: FeatureStore, repeat: int) -> float:
    """Best time per byte of zlib.crc32 over the set's chunk files (held in memory: CRC work only)."""
    fs = store.features("f")
    blobs = [integrity._chunk_file(fs, "data", b.index).read_bytes() for b in fs.blocks()]
    total = sum(len(b) for b in blobs)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for blob in blobs:
            zlib.crc32(blob)
        best = min(best, time.perf_counter() - t0)
    return best / total


def loader_rate(src: FeatureSource, store: FeatureStore, epochs: int) -> float:
    stream = PairStream(src, Tokens.from_store(store), store.split_rows("train"), store.caption_images(),
                        batch_size=128, captions="one", window_chunks=8, seed=0)
    best = 0.0
    for e in range(epochs):
        t0 = time.perf_counter()
        n = sum(1 for _ in stream.epoch(e))
        best = max(best, n / (time.perf_counter() - t0))
    return best


def step_seconds(dim: int, device: str, steps: int) -> float:
    """Median time of one VSE++ training step (encode both sides, hinge loss, backward, Adam)."""
    import torch

    from vsekit.models.losses import HingeLoss
    from vsekit.train.config import resolve_config
    from vsekit.train.trainer import build_model, make_optimizer

    cfg = resolve_config("vse", batch_size=128, embed_dim=1024, word_dim=300, device=device)
    net, _ = build_model(cfg, (dim,), VOCAB)
    net = net.to(device).train()
    optim = make_optimizer(cfg, net.parameters(), cfg.lr)
    loss_fn = HingeLoss(cfg.margin, max_violation=True)
    rng = np.random.default_rng(0)
    feats = torch.from_numpy(rng.normal(size=(128, dim)).astype(np.float32)).to(device)
    tokens = torch.from_numpy(rng.integers(4, VOCAB, size=(128, 12))).to(device)
    lengths = torch.full((128,), 12, dtype=torch.int64).to(device)
    images = torch.arange(128).to(device)
    times = []
    for i in range(steps + 3):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        scores = net.score(net.encode_images(feats, None), net.encode_captions(tokens, lengths))
        loss = loss_fn(scores, images)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.grad_clip)
        optim.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 3:   # warm-up steps left out
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linear_step_seconds(dim: int, device: str, steps: int) -> float:
    """Median time of the image side alone (a 2048 -> 1024 linear map, backward): the cheapest step
    any model makes, the bound bench/loader.py uses."""
    import torch

    fc = torch.nn.Linear(dim, 1024, bias=False).to(device)
    feats = torch.randn(128, dim, device=device)
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        fc(feats).square().mean().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        store = build(Path(tmp) / "b.zarr", args.images, args.dim)
        per_byte = crc_seconds_per_byte(store, args.repeat)
        checked = FeatureSource(store.features("f"))
        unchecked = FeatureSource(store.features("f"))
        unchecked.reader.check = None
        loader_rate(checked, store, 1)   # page cache warm
        r_on, r_off = loader_rate(checked, store, args.epochs), loader_rate(unchecked, store, args.epochs)
        chunk_rows = checked.chunk_rows
    step = step_seconds(args.dim, args.device, args.steps)
    linear = linear_step_seconds(args.dim, args.device, 5 * args.steps)
    batch_bytes = 128 * args.dim * 4
    crc_batch = per_byte * batch_bytes
    print(f"CPU threads available: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, "
          f"device: {args.device}")
    loader_extra = 1 / r_on - 1 / r_off
    print("| set | CRC-32 GB/s | CRC per batch (ms) | loader batches/s, checked | unchecked | "
          "loader time added per batch (ms) | VSE++ step (ms) | CRC / VSE++ step | linear step (ms) | "
          "CRC / linear step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.images} x {args.dim} float32, chunks of {chunk_rows} rows | {1 / per_byte / 1e9:.2f} | "
          f"{crc_batch * 1e3:.3f} | {r_on:.0f} | {r_off:.0f} | {loader_extra * 1e3:.3f} | {step * 1e3:.1f} | "
          f"{100 * crc_batch / step:.3f}% | {linear * 1e3:.2f} | {100 * crc_batch / linear:.1f}% |")


if __name__ == "__main__":
    main()
