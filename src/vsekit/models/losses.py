"""Similarities and ranking losses.

- Cosine similarity of L2-normalised vectors (Kiros et al. UVS; Faghri et al. VSE++).
- Order violation (Vendrov et al., ICLR 2016, eq. 2 and the order-embedding code): captions lie
  *above* their images in the partial order, ``E(c, i) = ||max(0, c - i)||^2`` and the similarity is
  ``S(c, i) = -E(c, i)`` (``order``; also the FNE paper's code, a fork of the order-embedding code).
- ``order-norm``: VSE++'s order score (Faghri et al., code ``model.order_sim``; their Order0 / Order++),
  the norm of the violation, ``S(c, i) = -||max(0, c - i)||``. Ranks equal those of ``order`` (a
  monotone map of it); the hinge loss, whose margin is in score units, differs.
- Hinge (triplet) loss with margin alpha over both directions (VSE++, eq. 4/5): summed over every
  negative in the batch ("sum of hinges", SH/SOE) or only the hardest one ("max of hinges", MH/MOE).
  Pairs that share an image (several captions of one image in a batch) are not negatives.

Similarities and losses are registered by name (``@register_similarity``, ``@register_loss``), as
the models are: a new one is one function or class in this file, and ``--similarity`` / the
``loss`` setting accept it. Losses are small callable objects; the trainer builds one with
``create_loss(name, margin=..., max_violation=...)``, calls ``loss(scores, images)`` and never
special-cases one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .base import lookup, register

_SIMILARITIES: dict[str, Callable] = {}
_LOSSES: dict[str, Callable] = {}


def register_similarity(name: str):
    """Register a similarity ``(img, cap) -> (n_img, n_cap) scores`` under ``name``."""
    return register(_SIMILARITIES, "similarity", name)


def register_loss(name: str):
    """Register a loss factory (``margin=``, ``max_violation=`` keywords; returns ``loss(scores, images)``)."""
    return register(_LOSSES, "loss", name)


@register_similarity("cosine")
def cosine_sim(img: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """(n_img, n_cap) dot products of already normalised vectors."""
    return img @ cap.t()


@register_similarity("order")
def order_sim(img: torch.Tensor, cap: torch.Tensor, max_elements: int = 1 << 25) -> torch.Tensor:
    """(n_img, n_cap) ``-||max(0, c - i)||^2``, in blocks of at most ``max_elements`` temporaries.

    Without gradients (evaluation), float32 CPU inputs go to the fused numba kernel of
    :mod:`vsekit.models.kernels`: no temporaries and about 10x faster than tensor operations.
    Otherwise (training, other devices, no numba) each block is one subtraction, an in-place clamp
    and a dot product with itself, so the temporary stays ``max_elements`` floats (64 images x 512
    captions x 1024 dims by default) and never becomes the n_img x n_cap x dim tensor of naive
    broadcasting.
    """
    if _fused_ok(img, cap):
        from vsekit.models.kernels import order_violation

        out = order_violation(img.detach().numpy(), cap.detach().numpy())
        if out is not None:
            return torch.from_numpy(out)
    n_img, n_cap, dim = img.shape[0], cap.shape[0], img.shape[1]
    if n_img * n_cap * dim <= max_elements:
        t = (cap[None, :, :] - img[:, None, :]).clamp(min=0)
        return -(t * t).sum(-1)
    bi = max(1, min(n_img, 64))
    bc = max(1, max_elements // (bi * max(1, dim)))
    out = img.new_empty(n_img, n_cap)
    for a in range(0, n_img, bi):
        ib = img[a:a + bi, None, :]
        for s in range(0, n_cap, bc):
            t = torch.sub(cap[None, s:s + bc, :], ib).clamp_(min=0)
            out[a:a + bi, s:s + bc] = torch.linalg.vecdot(t, t).neg_()
    return out


@register_similarity("order-norm")
def order_norm_sim(img: torch.Tensor, cap: torch.Tensor, max_elements: int = 1 << 25) -> torch.Tensor:
    """(n_img, n_cap) ``-||max(0, c - i)||`` (VSE++'s order score): the square root of :func:`order_sim`.

    The root of a zero violation has an infinite derivative; there the score is exactly 0 with a zero
    gradient (the violation is at its minimum), so training never produces NaNs.
    """
    scores = order_sim(img, cap, max_elements)
    if not scores.requires_grad:
        return scores.neg_().clamp_min_(0).sqrt_().neg_()
    sq = -scores
    positive = sq > 0
    return -torch.where(positive, sq, torch.ones_like(sq)).sqrt() * positive


def _fused_ok(img: torch.Tensor, cap: torch.Tensor) -> bool:
    """Whether the fused evaluation kernel applies: no autograd, float32, CPU, plain 2-D."""
    if torch.is_grad_enabled() and (img.requires_grad or cap.requires_grad):
        return False
    return (img.dtype == cap.dtype == torch.float32 and img.device.type == cap.device.type == "cpu"
            and img.dim() == cap.dim() == 2)


def similarity(name: str):
    """The registered similarity ``name``; an unknown name lists the valid ones."""
    return lookup(_SIMILARITIES, "similarity", name)


def create_loss(name: str, **kwargs: Any):
    """The registered loss ``name`` built with ``kwargs``; an unknown name lists the valid ones."""
    return lookup(_LOSSES, "loss", name)(**kwargs)


@register_loss("hinge")
class HingeLoss:
    """Bidirectional hinge loss on a (B, B) image x caption score matrix with positives on the diagonal.

    ``max_violation=False`` sums over all negatives; ``True`` keeps only the hardest negative of each
    image and of each caption. The result is summed over the batch (as VSE++ and the FNE paper).
    """

    def __init__(self, margin: float = 0.2, max_violation: bool = False):
        self.margin = float(margin)
        self.max_violation = bool(max_violation)

    def __call__(self, scores: torch.Tensor, images: torch.Tensor | None = None) -> torch.Tensor:
        pos = scores.diagonal()
        cost_cap = (self.margin + scores - pos[:, None]).clamp(min=0)  # image i vs wrong caption c
        cost_img = (self.margin + scores - pos[None, :]).clamp(min=0)  # caption c vs wrong image i
        n = scores.shape[0]
        positive = torch.eye(n, dtype=torch.bool, device=scores.device)
        if images is not None:
            positive = images[:, None] == images[None, :]
        cost_cap = cost_cap.masked_fill(positive, 0)
        cost_img = cost_img.masked_fill(positive, 0)
        if self.max_violation:
            return cost_cap.max(dim=1).values.sum() + cost_img.max(dim=0).values.sum()
        return cost_cap.sum() + cost_img.sum()

    def __repr__(self) -> str:
        return f"HingeLoss(margin={self.margin}, max_violation={self.max_violation})"


def loss_names() -> tuple[str, ...]:
    return tuple(_LOSSES)


SIMILARITIES = tuple(_SIMILARITIES)
