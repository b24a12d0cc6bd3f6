"""Benchmark: blockwise evaluation vs a naive reference on COCO-5K-sized random embeddings.

Fast path: ``vsekit.train.evaluation.compute_ranks`` (similarities in bounded blocks, ranks by
counting). Naive reference (the usual research code): the full similarity matrix (order similarity by
broadcasting 100 images at a time) and a full argsort per query. Both report the same metrics; we
print seconds, peak RSS growth and the speed-up.

    python bench/evaluate.py                      # cosine at 5,000 x 25,000 x 1,024; order at --order-images
    python bench/evaluate.py --order-images 5000  # order at full COCO-5K size (slow on a small CPU)

Order similarity at 5,000 x 25,000 x 1,024 is 1.3e11 element operations for either method; on a
2-core shared machine that is tens of minutes, so the default measures order on the first 1,000
images and their 5,000 captions (the same per-element work; ``--order-images 5000`` for the full set).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import psutil
import torch

from vsekit.train.evaluation import compute_ranks, metrics_from_ranks
from vsekit.train.losses import cosine_sim, order_sim


class PeakRSS:
    """Peak resident memory growth (MB) while the block runs, sampled every 5 ms."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.mb = (self.peak - self.base) / 2**20


def embeddings(n_img, per, dim, order, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(n_img, dim, generator=g)
    cap = img.repeat_interleave(per, 0) + 10.0 * torch.randn(n_img * per, dim, generator=g)
    img, cap = torch.nn.functional.normalize(img, dim=1), torch.nn.functional.normalize(cap, dim=1)
    if order:
        img, cap = img.abs(), cap.abs()
    return img, cap, np.repeat(np.arange(n_img), per)


def fast(img, cap, cap_img, sim):
    ranks = compute_ranks(lambda i, c: sim(img[i], cap[c]), len(img), cap_img)
    return metrics_from_ranks(*ranks)


def naive(img, cap, cap_img, sim_name):
    if sim_name == "cosine":
        S = (img @ cap.t()).numpy()
    else:
        S = np.empty((len(img), len(cap)), dtype=np.float32)
        for a in range(0, len(img), 100):  # broadcasting 100 images at a time
            S[a:a + 100] = (-(cap[None, :, :] - img[a:a + 100, None, :]).clamp(min=0).pow(2).sum(-1)).numpy()
    i2t = np.empty(len(img), dtype=np.int64)
    for i in range(len(img)):
        order = np.argsort(-S[i], kind="stable")
        gts = np.isin(order, np.flatnonzero(cap_img == i))
        first = int(np.argmax(gts))
        i2t[i] = first  # position of the best caption; the other captions before it are non-matching
    t2i = np.empty(len(cap), dtype=np.int64)
    for c in range(len(cap)):
        t2i[c] = int(np.flatnonzero(np.argsort(-S[:, c], kind="stable") == cap_img[c])[0])
    return metrics_from_ranks(i2t, t2i)


def run(sim_name, n_img, per, dim, skip_naive):
    img, cap, cap_img = embeddings(n_img, per, dim, sim_name == "order")
    sim = cosine_sim if sim_name == "cosine" else order_sim
    with PeakRSS() as mem_f:
        t0 = time.perf_counter()
        m_fast = fast(img, cap, cap_img, sim)
        t_fast = time.perf_counter() - t0
    row = {"sim": sim_name, "images": n_img, "captions": len(cap), "dim": dim,
           "fast_s": t_fast, "fast_mb": mem_f.mb, "rsum": m_fast["rsum"]}
    if not skip_naive:
        with PeakRSS() as mem_n:
            t0 = time.perf_counter()
            m_naive = naive(img, cap, cap_img, sim_name)
            t_naive = time.perf_counter() - t0
        diff = max(abs(m_fast[k] - m_naive[k]) for k in m_fast)
        same = "yes" if diff == 0 else f"max diff {diff:.2g}"
        row.update(naive_s=t_naive, naive_mb=mem_n.mb, speedup=t_naive / t_fast, identical=same)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--per-image", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--order-images", type=int, default=1000, help="images for the order benchmark")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run("cosine", args.images, args.per_image, args.dim, args.skip_naive),
            run("order", args.order_images, args.per_image, args.dim, args.skip_naive)]
    print("| similarity | images x captions x dim | blockwise s | peak MB | naive s | peak MB | speed-up | identical metrics | rsum |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sim']} | {r['images']} x {r['captions']} x {r['dim']} | {r['fast_s']:.1f} | {r['fast_mb']:.0f} | "
              f"{r.get('naive_s', float('nan')):.1f} | {r.get('naive_mb', float('nan')):.0f} | "
              f"{r.get('speedup', float('nan')):.1f}x | {r.get('identical', '-')} | {r['rsum']:.1f} |")


if __name__ == "__main__":
    main()
