"""Retrieval evaluation: ranks from similarities computed in bounded blocks, the metrics, protocols.

The common protocol (Karpathy & Fei-Fei; VSE++; SCAN) as docs/train.md, "Evaluation", defines it:
image→text ranks an image by the best of its captions, text→image each caption's image; R@1/5/10,
Med r, Mean r, MRR and rsum; ``coco-1k`` averages five folds (its rsum is the sum of the averaged
recalls), ``coco-5k`` and ``1k`` use the whole split. Ranks are counted, not sorted (ties count against
the query), from blocks of ``max_elements`` scores: the full matrix is never held in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

PROTOCOLS = ("coco-1k", "coco-5k", "1k")
RECALLS = (1, 5, 10)
METRIC_KEYS = tuple(f"{d}_{m}" for d in ("i2t", "t2i") for m in ("r1", "r5", "r10", "medr", "meanr", "mrr"))

Scorer = Callable[[Any, Any], torch.Tensor]


def as_selection(idx: np.ndarray) -> slice | np.ndarray:
    """A contiguous increasing index array becomes a slice (so encodings are viewed, not copied)."""
    idx = np.asarray(idx, dtype=np.int64)
    if len(idx) and idx[-1] - idx[0] == len(idx) - 1 and np.all(np.diff(idx) == 1):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def compute_ranks(scorer: Scorer, n_images: int, caption_image: np.ndarray, *,
                  images: np.ndarray | None = None, captions: np.ndarray | None = None,
                  max_elements: int = 1 << 23, progress: bool = False, share: Any = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """0-based image→text and text→image ranks, scoring blocks through ``scorer(img_sel, cap_sel)``.

    ``caption_image[c]`` is the index of caption c's image. ``images``/``captions`` restrict the
    problem to a subset (a fold): then ``caption_image`` is still indexed by global caption and its
    values are global image indices. Memory is O(max_elements + n_images + n_captions).

    ``share`` (data-parallel ranks, :class:`vsekit.train.distributed.Group`): this process scores
    only its contiguous part of the captions (``share.part``) against every image; each image's best
    match is the maximum over the ranks and its count of higher-scoring captions the sum
    (``share.reduce_array``), so every rank returns the ranks of one process, each score computed once.
    """
    caption_image = np.asarray(caption_image, dtype=np.int64)
    images = np.arange(n_images) if images is None else np.asarray(images, dtype=np.int64)
    captions = np.arange(len(caption_image)) if captions is None else np.asarray(captions, dtype=np.int64)
    local = np.full(max(n_images, int(images.max(initial=0)) + 1), -1, dtype=np.int64)
    local[images] = np.arange(len(images))
    cap_img = local[caption_image[captions]]  # each caption's image as an index into ``images``
    if np.any(cap_img < 0):
        raise ValueError("every caption's image must be among the evaluated images")
    n_img, n_cap = len(images), len(captions)
    if np.bincount(cap_img, minlength=n_img).min(initial=1) == 0:
        raise ValueError("every evaluated image needs at least one caption")

    mine = slice(0, n_cap) if share is None else share.part(n_cap)   # the captions this process scores
    c0, c1 = mine.start, mine.stop

    # 1. each caption's matching score, from small blocks of (its images x captions)
    gt = np.full(n_cap, -np.inf, dtype=np.float64)
    step = max(1, min(512, int(max_elements ** 0.5)))  # ~step/5 images per block: ~1% extra work
    for p in range(c0, c1, step):
        q = min(p + step, c1)
        uniq, inv = np.unique(cap_img[p:q], return_inverse=True)
        s = _np(scorer(as_selection(images[uniq]), as_selection(captions[p:q])))
        gt[p:q] = s[inv, np.arange(q - p)]
    best = np.full(n_img, -np.inf)
    np.maximum.at(best, cap_img[c0:c1], gt[c0:c1])
    if share is not None:
        best = share.reduce_array(best, "max")

    # 2. count non-matching scores >= the match, block by block
    i2t = np.zeros(n_img, dtype=np.int64)
    t2i = np.zeros(n_cap, dtype=np.int64)
    img_step = max(1, min(n_img, max_elements // max(1, n_cap)))
    cap_step = max(1, min(n_cap, max_elements // img_step))
    gt_t = torch.from_numpy(gt).to(torch.float32)      # scores are float32: compare in float32,
    best_t = torch.from_numpy(best).to(torch.float32)  # without a float64 copy of every block
    cap_img_t = torch.from_numpy(cap_img)
    blocks = range(0, n_img, img_step)
    if progress:
        from tqdm.auto import tqdm
        blocks = tqdm(blocks, desc="similarities", unit="block", leave=False)
    for a in blocks:
        b = min(a + img_step, n_img)
        rows = torch.arange(a, b)
        for p in range(c0, c1, cap_step):
            q = min(p + cap_step, c1)
            s = scorer(as_selection(images[a:b]), as_selection(captions[p:q])).detach().to("cpu", torch.float32)
            match = cap_img_t[p:q][None, :] == rows[:, None]
            i2t[a:b] += ((s >= best_t[a:b, None]) & ~match).sum(1).numpy()
            t2i[p:q] += ((s >= gt_t[None, p:q]) & ~match).sum(0).numpy()
    if share is not None:   # another rank's captions count 0 here
        i2t, t2i = share.reduce_array(i2t, "sum"), share.reduce_array(t2i, "sum")
    return i2t, t2i


def _np(x: Any) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


def metrics_from_ranks(i2t: np.ndarray, t2i: np.ndarray) -> dict[str, float]:
    """R@1/5/10, Med r, Mean r and MRR in both directions, and rsum of the six recalls."""
    out: dict[str, float] = {}
    for name, ranks in (("i2t", np.asarray(i2t)), ("t2i", np.asarray(t2i))):
        for k in RECALLS:
            out[f"{name}_r{k}"] = float(100.0 * np.mean(ranks < k))
        out[f"{name}_medr"] = float(np.floor(np.median(ranks)) + 1)
        out[f"{name}_meanr"] = float(np.mean(ranks) + 1)
        out[f"{name}_mrr"] = float(np.mean(1.0 / (ranks + 1)))
    out["rsum"] = rsum(out)
    return out


def rsum(metrics: dict[str, float]) -> float:
    return float(sum(metrics[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALLS))


def average_metrics(folds: Iterable[dict[str, float]]) -> dict[str, float]:
    """Mean of every metric over folds; rsum is the sum of the averaged recalls."""
    folds = list(folds)
    out = {k: float(np.mean([f[k] for f in folds])) for k in METRIC_KEYS}
    out["rsum"] = rsum(out)
    return out


def protocol_folds(n_images: int, protocol: str) -> list[np.ndarray]:
    """Image index sets of a protocol: five consecutive folds (``coco-1k``) or the whole split."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; valid choices: {', '.join(PROTOCOLS)}")
    if protocol == "coco-1k":
        if n_images < 5:
            raise ValueError(f"--protocol coco-1k needs at least 5 test images, the split has {n_images}")
        return [f for f in np.array_split(np.arange(n_images), 5)]
    return [np.arange(n_images)]


def evaluate_protocol(scorer: Scorer, n_images: int, caption_image: np.ndarray, protocol: str,
                      **kw: Any) -> dict[str, Any]:
    """The metrics of one protocol (fold metrics averaged for coco-1k), plus the per-fold metrics."""
    caption_image = np.asarray(caption_image, dtype=np.int64)
    folds = []
    for imgs in protocol_folds(n_images, protocol):
        caps = np.flatnonzero(np.isin(caption_image, imgs))
        folds.append(metrics_from_ranks(*compute_ranks(scorer, n_images, caption_image,
                                                       images=imgs, captions=caps, **kw)))
    result: dict[str, Any] = average_metrics(folds) if len(folds) > 1 else dict(folds[0])
    if len(folds) > 1:
        result["folds"] = folds
    return result


# the papers' table --------------------------------------------------------------------------------
def format_table(rows: Sequence[tuple[str, str, dict[str, float]]]) -> str:
    """Rows of (run, protocol, metrics) in the papers' layout: caption retrieval | image retrieval | rsum."""
    head1 = f"{'':<28} {'':<8} | {'Image→Text (caption retrieval)':^42} | {'Text→Image (image retrieval)':^42} |"
    cols = f"{'R@1':>6} {'R@5':>6} {'R@10':>6} {'Med r':>6} {'Mean r':>7} {'MRR':>6}"
    head2 = f"{'run':<28} {'protocol':<8} | {cols}  | {cols}  | {'rsum':>7}"
    lines = [head1, head2, "-" * len(head2)]
    for run, protocol, m in rows:
        parts = []
        for d in ("i2t", "t2i"):
            parts.append(f"{m[d + '_r1']:6.1f} {m[d + '_r5']:6.1f} {m[d + '_r10']:6.1f} "
                         f"{m[d + '_medr']:6.1f} {m[d + '_meanr']:7.1f} {m[d + '_mrr']:6.3f}")
        name = run if len(run) <= 28 else "…" + run[-27:]
        lines.append(f"{name:<28} {protocol:<8} | {parts[0]}  | {parts[1]}  | {m['rsum']:7.1f}")
    return "\n".join(lines)
