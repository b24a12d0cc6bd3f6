"""Encode an evaluation set with one or several models and score it block by block.

Encodings of any model (a tensor, or a tuple of per-item tensors for pairwise models) are
concatenated and sliced along the first dimension; several models' block scores are averaged
(SGRAF = SAF run + SGR run).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..models.base import RetrievalModel
from .data import EvalSet, FeatureSource, Tokens, image_batches
from .distributed import pad_to


def cat(parts: list[Any]) -> Any:
    """Concatenate per-batch encodings (tensors, tuples of them, or None) along dim 0."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        # pairwise models' per-word states are as wide as their batch's longest caption: zero-pad (False
        # for masks) every dim after the first to the largest; the models mask padding, so zeros are inert
        target = [max(p.shape[d] for p in parts) for d in range(1, first.dim())]
        return torch.cat([pad_to(p, (p.shape[0], *target)) for p in parts], dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(cat([p[i] for p in parts]) for i in range(len(first)))
    raise TypeError(f"cannot concatenate encodings of type {type(first).__name__}")


def take(enc: Any, sel: Any) -> Any:
    """Rows ``sel`` (a slice or an index array) of an encoding."""
    if enc is None:
        return None
    if isinstance(enc, torch.Tensor):
        return enc[sel] if isinstance(sel, slice) else enc[torch.as_tensor(sel)]
    if isinstance(enc, (tuple, list)):
        return type(enc)(take(e, sel) for e in enc)
    raise TypeError(f"cannot index encodings of type {type(enc).__name__}")


@contextmanager
def evaluating(*models: torch.nn.Module) -> Iterator[None]:
    """Every module of ``models`` in eval mode inside the block, each restored to its own mode after.

    The modes are restored module by module (not ``model.train(flag)`` on the root), so a model
    whose parts were in different modes comes back exactly as it was.
    """
    saved = [(m, m.training) for model in models for m in model.modules()]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@torch.no_grad()
def encode_set(model: RetrievalModel, source: FeatureSource, tokens: Tokens, evalset: EvalSet, *,
               batch_size: int = 256, device: str = "cpu", group: Any = None) -> tuple[Any, Any]:
    """Image encodings of ``evalset.rows`` and caption encodings of ``evalset.captions``.

    With data-parallel ranks (``group``), each rank reads and encodes its contiguous part of the
    images and of the captions, and every rank receives all of them (gathered in rank order, so the
    encodings are those of one process). A set smaller than the rank count is encoded whole by
    every rank.
    """
    n_img, n_cap = len(evalset.rows), len(evalset.captions)
    if group is not None and group.distributed and min(n_img, n_cap) >= group.world:
        ip, cp = group.part(n_img), group.part(n_cap)
        mine = EvalSet(evalset.rows[ip], evalset.captions[cp], evalset.caption_image[cp])
        img, cap = encode_set(model, source, tokens, mine, batch_size=batch_size, device=device)
        return (group.gather(img, group.sizes(n_img), autograd=False),
                group.gather(cap, group.sizes(n_cap), autograd=False))
    with evaluating(model):
        imgs = []
        for feats, counts in image_batches(source, evalset.rows, batch_size):
            imgs.append(model.encode_images(feats.to(device), None if counts is None else counts.to(device)))
        caps = []
        for s in range(0, len(evalset.captions), batch_size):
            toks, lengths = tokens.batch(evalset.captions[s:s + batch_size])
            caps.append(model.encode_captions(toks.to(device), lengths.to(device)))
    return cat(imgs), cat(caps)


class EnsembleScorer:
    """``scorer(img_sel, cap_sel)``: the mean of every model's ``score`` on those rows.

    Every call scores with the models in eval mode (SAF's batch norm on its running estimates,
    dropout off) and leaves them in the mode it found them in.
    """

    def __init__(self, models: Sequence[RetrievalModel], encodings: Sequence[tuple[Any, Any]]):
        self.models, self.encodings = list(models), list(encodings)

    @torch.no_grad()
    def __call__(self, img_sel: Any, cap_sel: Any) -> torch.Tensor:
        total = None
        with evaluating(*self.models):
            for model, (img, cap) in zip(self.models, self.encodings):
                s = model.score(take(img, img_sel), take(cap, cap_sel)).float()
                total = s if total is None else total + s
        return total / len(self.models)


def save_sims(scorer: EnsembleScorer, n_images: int, n_captions: int, path: str, max_elements: int = 1 << 23) -> None:
    """Write the (n_images, n_captions) similarity matrix to ``path`` (.npy) in row blocks."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n_images, n_captions))
    step = max(1, max_elements // max(1, n_captions))
    for a in range(0, n_images, step):
        b = min(a + step, n_images)
        out[a:b] = scorer(slice(a, b), slice(0, n_captions)).cpu().numpy()
    out.flush()
    del out
