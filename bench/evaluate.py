"""Benchmark: blockwise evaluation vs a naive reference on COCO-5K-sized random embeddings.

Fast path: ``vsekit.train.evaluation.compute_ranks`` (similarities in bounded blocks, ranks by
counting; order similarity through the fused kernel of ``vsekit.models.kernels``). Naive reference
(the usual research code): the full similarity matrix (order similarity by broadcasting 100 images
at a time) and a full argsort per query. We print seconds, peak RSS growth, the speed-up, and
whether the metrics print the same (with how many ranks moved: the two compute each float32 score
with a different summation order, so a near-tie can land on the other side).

    python bench/evaluate.py                      # cosine at 5,000 x 25,000 x 1,024; order at --order-images
    python bench/evaluate.py --order-images 5000  # naive order at full COCO-5K size (needs ~30 GB)

The naive order reference broadcasts 100 images x 25,000 captions x 1,024 dims, a 10 GB temporary
(and clamp and pow make two more), which does not fit this machine; so the comparison runs on the
first 1,000 images and their 5,000 captions (the same per-element work) and the blockwise method is
also timed alone at full size.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import psutil
import torch

from vsekit.train.evaluation import compute_ranks, metrics_from_ranks
from vsekit.models.losses import cosine_sim, order_sim


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
    return compute_ranks(lambda i, c: sim(img[i], cap[c]), len(img), cap_img)


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
    return i2t, t2i


PRINTED = {"r": 1, "medr": 0, "meanr": 1, "mrr": 3}  # decimals of the papers' table layout


def printed_equal(a, b):
    """Whether two metric dicts print the same (recalls and Mean r to 0.1, MRR to 0.001)."""
    for k in a:
        kind = "rsum" if k == "rsum" else k.split("_")[1].rstrip("0123456789")
        d = PRINTED.get(kind, 1)
        if round(a[k], d) != round(b[k], d):
            return False
    return True


def run(sim_name, n_img, per, dim, skip_naive):
    img, cap, cap_img = embeddings(n_img, per, dim, sim_name == "order")
    sim = cosine_sim if sim_name == "cosine" else order_sim
    with PeakRSS() as mem_f:
        t0 = time.perf_counter()
        r_fast = fast(img, cap, cap_img, sim)
        t_fast = time.perf_counter() - t0
    m_fast = metrics_from_ranks(*r_fast)
    row = {"sim": sim_name, "images": n_img, "captions": len(cap), "dim": dim,
           "fast_s": t_fast, "fast_mb": mem_f.mb, "rsum": m_fast["rsum"]}
    if not skip_naive:
        with PeakRSS() as mem_n:
            t0 = time.perf_counter()
            r_naive = naive(img, cap, cap_img, sim_name)
            t_naive = time.perf_counter() - t0
        m_naive = metrics_from_ranks(*r_naive)
        moved = [np.flatnonzero(a != b) for a, b in zip(r_fast, r_naive)]
        shift = max((int(np.abs(a - b).max()) for a, b in zip(r_fast, r_naive) if len(a)), default=0)
        n_moved = sum(len(m) for m in moved)
        same = "yes" if printed_equal(m_fast, m_naive) else "NO"
        row.update(naive_s=t_naive, naive_mb=mem_n.mb, speedup=t_naive / t_fast,
                   identical=f"{same} ({n_moved} of {len(img) + len(cap)} ranks moved, by <= {shift})")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--per-image", type=int, default=5)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--order-images", type=int, default=1000, help="images for the order benchmark")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--no-full-order", action="store_true",
                    help="skip the blockwise-only order run at the full --images size")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run("cosine", args.images, args.per_image, args.dim, args.skip_naive),
            run("order", args.order_images, args.per_image, args.dim, args.skip_naive)]
    if args.order_images != args.images and not args.no_full_order:
        # the naive reference cannot run here: 100 images x 25,000 captions x 1,024 dims is a 10 GB
        # temporary, and clamp/pow make two more
        rows.append(run("order", args.images, args.per_image, args.dim, skip_naive=True))
    print("| similarity | images x captions x dim | blockwise s | peak MB | naive s | peak MB | speed-up | same printed metrics | rsum |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sim']} | {r['images']} x {r['captions']} x {r['dim']} | {r['fast_s']:.1f} | {r['fast_mb']:.0f} | "
              f"{r.get('naive_s', float('nan')):.1f} | {r.get('naive_mb', float('nan')):.0f} | "
              f"{r.get('speedup', float('nan')):.1f}x | {r.get('identical', '-')} | {r['rsum']:.1f} |")


if __name__ == "__main__":
    main()
