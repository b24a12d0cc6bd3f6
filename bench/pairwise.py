"""Benchmark: blockwise pairwise scoring vs the reference codes' per-caption loop; SGR forward time
with the T-EMDE global module vs the global self-attention.

1. Scoring throughput (pairs/s) of every image x caption pair of an evaluation set, for SGR, SAF and
   SMAN, both ways, in the same run and on the same encodings:

   * ``loop``       the SGRAF reference's ``shard_attn_scores``: shards of 100 images x 100 captions,
                    and inside each shard a Python loop over the captions, each cut to its true
                    length (as the reference's ``cap_emb[i, :n_word]``) and scored against all the
                    shard's images (``model._score_block(shard, one caption)`` here, i.e. the same
                    batched kernels, so the loop is as fast as a per-caption loop can be);
   * ``blockwise``  ``model.score(images, captions)``: the whole block in batched tensor ops, captions
                    grouped by length, cut by the model into sub-blocks of bounded size.

   The scores of both are compared (max |difference|). Both are warmed up, then timed twice,
   alternating; the best of the two counts.
2. SGR inference forward on one training-sized batch (``--forward-batch``, default 128, the
   presets' batch) with ``global_module="t-emde"`` against ``"self-attention"``: the whole forward
   (encode + score the B x B block) and the global module alone (the only part that differs),
   alternating the two models so machine load hits both alike; the median of the repeats.

Two sizes by default: ``demo`` dims (joint 64, similarity 32, hidden 64) and ``paper`` dims (joint
1024, similarity 256, SMAN hidden 512, 2048-d regions/cells), 36 region slots with 10-36 real ones,
7x7 grids, captions of 8-16 words. Random weights and inputs (speed does not depend on training).
Usage: ``python bench/pairwise.py [--sizes demo,paper] [--threads 2] [--forward-batch 128]
[--out bench/results/pairwise.md]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/tokenize.py must not shadow the standard library's tokenize

import argparse
import statistics
import time

import torch

HERE = Path(__file__).resolve().parent
SIZES = {
    # name: dims, images x captions scored, forward batch, SMAN hidden
    "demo": {"embed_dim": 64, "sim_dim": 32, "word_dim": 32, "img_dim": 512, "hidden": 64,
             "images": 100, "captions": 400, "batch": 64},
    "paper": {"embed_dim": 1024, "sim_dim": 256, "word_dim": 300, "img_dim": 2048, "hidden": 512,
              "images": 100, "captions": 200, "batch": 16},
}
K, GRID, VOCAB, SHARD = 36, 7, 1000, 100


def inputs(n_img: int, n_cap: int, img_dim: int, grid: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if grid:
        feats = torch.randn(n_img, GRID, GRID, img_dim, generator=g)
        counts = None
    else:
        feats = torch.randn(n_img, K, img_dim, generator=g)
        counts = torch.randint(10, K + 1, (n_img,), generator=g)
    lengths = torch.randint(8, 17, (n_cap,), generator=g)
    tokens = torch.randint(4, VOCAB, (n_cap, int(lengths.max())), generator=g)
    return feats, counts, tokens, lengths


def build(name: str, size: dict, **kw):
    from vsekit.train.base import create_model

    torch.manual_seed(0)
    if name.startswith("sman"):
        return create_model(name, img_shape=(GRID, GRID, size["img_dim"]), vocab_size=VOCAB,
                            embed_dim=size["hidden"], word_dim=size["word_dim"]).eval()
    return create_model(name, img_shape=(K, size["img_dim"]), vocab_size=VOCAB, embed_dim=size["embed_dim"],
                        word_dim=size["word_dim"], sim_dim=size["sim_dim"], **kw).eval()


def take(enc, sel):
    return tuple(t[sel] for t in enc)


def one_caption(cap, j):
    """Caption j alone, cut to its true length as the reference does (``cap_emb[i, :n_word]``)."""
    one = take(cap, slice(j, j + 1))
    mask = next((t for t in one if t.dtype == torch.bool and t.dim() == 2), None)
    if mask is None:
        return one
    n, width = max(1, int(mask.sum())), mask.shape[1]
    per_word = [t is mask or (t.dim() >= 3 and t.shape[1] == width) for t in one]
    return tuple(t[:, :n] if w else t for t, w in zip(one, per_word))


def loop_scores(model, img, cap) -> torch.Tensor:
    """The reference's way: image shards x caption shards, one caption at a time inside a shard,
    each caption cut to its own length (so the loop wastes nothing on padding)."""
    n_img, n_cap = img[0].shape[0], cap[0].shape[0]
    out = torch.empty(n_img, n_cap)
    score_one = getattr(model, "_score_block", model.score)
    for a in range(0, n_img, SHARD):
        shard = take(img, slice(a, a + SHARD))
        for b in range(0, n_cap, SHARD):
            for j in range(b, min(b + SHARD, n_cap)):
                out[a:a + SHARD, j] = score_one(shard, one_caption(cap, j))[:, 0]
    return out


@torch.no_grad()
def bench_scoring(name: str, size: dict, **kw) -> dict:
    model = build(name, size, **kw)
    feats, counts, tokens, lengths = inputs(size["images"], size["captions"], size["img_dim"], name.startswith("sman"))
    img, cap = model.encode_images(feats, counts), model.encode_captions(tokens, lengths)
    pairs = size["images"] * size["captions"]
    warm = (take(img, slice(0, 4)), take(cap, slice(0, 8)))
    model.score(*warm), loop_scores(model, *warm)  # first calls allocate; keep them out of the timing
    t_block = t_loop = float("inf")
    for _ in range(2):  # best of two, alternating, so a burst of machine load hits neither alone
        t = time.perf_counter()
        blockwise = model.score(img, cap)
        t_block = min(t_block, time.perf_counter() - t)
        t = time.perf_counter()
        looped = loop_scores(model, img, cap)
        t_loop = min(t_loop, time.perf_counter() - t)
    row = {"model": name + (f" ({kw['global_module']})" if kw else ""), "pairs": pairs,
           "loop": pairs / t_loop, "block": pairs / t_block, "speedup": t_loop / t_block,
           "diff": float((blockwise - looped).abs().max())}
    print(row, flush=True)
    return row


@torch.no_grad()
def bench_forward(size: dict, batch: int, repeats: int = 5) -> dict:
    """SGR inference forward of one training-sized batch, T-EMDE vs self-attention.

    Two timings per model, alternating the models so machine load hits both alike, median of the
    repeats: the whole forward (encode ``batch`` images and captions, score the batch x batch
    block), and the global module alone (the image and caption global vectors and the
    batch x batch global similarity nodes), which is the only part where the two models differ.
    """
    feats, counts, tokens, lengths = inputs(batch, batch, size["img_dim"], False, seed=1)
    models = {g: build("sgr", size, global_module=g) for g in ("self-attention", "t-emde")}
    full: dict[str, list[float]] = {g: [] for g in models}
    glob: dict[str, list[float]] = {g: [] for g in models}
    for r in range(repeats + 1):
        for g, m in (models.items() if r % 2 == 0 else reversed(list(models.items()))):
            t = time.perf_counter()
            img, cap = m.encode_images(feats, counts), m.encode_captions(tokens, lengths)
            m.score(img, cap)
            t_full = time.perf_counter() - t
            t = time.perf_counter()
            m.global_node(m._global_image(img[0], img[1]), m._global_caption(cap[0], cap[1]))
            t_glob = time.perf_counter() - t
            if r:  # the first round warms up
                full[g].append(t_full)
                glob[g].append(t_glob)
    med = {f"{k}_{g}": statistics.median(v[g]) for k, v in (("full", full), ("global", glob)) for g in models}
    return {"batch": batch, **med, "ratio": med["full_t-emde"] / med["full_self-attention"],
            "global_ratio": med["global_t-emde"] / med["global_self-attention"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="demo,paper", help="comma-separated: " + ", ".join(SIZES))
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=5, help="forward-latency repeats per model")
    ap.add_argument("--forward-batch", type=int, default=128,
                    help="batch of the SGR forward timing (default: the presets' training batch, 128; "
                         "0 = each size's own batch)")
    ap.add_argument("--out", default=str(HERE / "results" / "pairwise.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = []
    for sname in args.sizes.split(","):
        size = SIZES[sname]
        rows = [bench_scoring("sgr", size, global_module="self-attention"),
                bench_scoring("sgr", size, global_module="t-emde"),
                bench_scoring("saf", size, global_module="self-attention"),
                bench_scoring("sman", size)]
        fwd = bench_forward(size, args.forward_batch or size["batch"], args.repeats)
        lines += [f"### {sname} dims: joint {size['embed_dim']}, similarity {size['sim_dim']}, SMAN hidden "
                  f"{size['hidden']}, features {size['img_dim']}; {size['images']} images x {size['captions']} captions",
                  "", "| model | pairs | per-caption loop (pairs/s) | blockwise (pairs/s) | speed-up | max abs diff |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {r['model']} | {r['pairs']:,} | {r['loop']:,.0f} | {r['block']:,.0f} | {r['speedup']:.2f}x | "
                  f"{r['diff']:.1e} |" for r in rows]
        b = fwd["batch"]
        lines += ["", f"SGR inference forward on a batch of {b} images and {b} captions, median of {args.repeats}:", "",
                  "| | self-attention (ms) | T-EMDE (ms) | T-EMDE / self-attention |", "| --- | ---: | ---: | ---: |",
                  f"| whole forward (encode, score {b}x{b}) | {fwd['full_self-attention'] * 1000:.0f} | "
                  f"{fwd['full_t-emde'] * 1000:.0f} | {fwd['ratio']:.2f} |",
                  f"| global module (global vectors, {b}x{b} global nodes) | {fwd['global_self-attention'] * 1000:.0f} | "
                  f"{fwd['global_t-emde'] * 1000:.0f} | {fwd['global_ratio']:.2f} |", ""]
        print("\n".join(lines[-len(rows) - 10:]), flush=True)
    header = ["# Pairwise scoring benchmark (`bench/pairwise.py`)", "",
              f"Command: `.venv/bin/python bench/pairwise.py --sizes {args.sizes} --threads {args.threads}`  ",
              "Machine: CPU only, 2 cores; the ratios compare runs made back to back in one process.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(header + lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
