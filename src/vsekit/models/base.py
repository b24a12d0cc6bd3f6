"""The contract every retrieval model meets, and the registry each model module registers into.

A model encodes each side once and scores any images x captions block::

    img = model.encode_images(feats, counts)          # per-image encodings (tensor or tuple)
    cap = model.encode_captions(tokens, lengths)      # per-caption encodings
    S = model.score(img, cap)                         # (n_img, n_cap) similarities

Embedding models (VSE++, Order, SEAM) return vectors and score with a matrix product or the order
violation; pairwise models (SMAN, SAF, SGR) keep per-item states and score every pair in batched
tensor operations. Evaluation calls ``score`` on bounded blocks, so memory never depends on the
test-set size. ``extra_loss`` adds model-specific terms (SEAM's attention penalty, SMAN's intra-pair
term) to the ranking loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

_MODELS: dict[str, Callable[..., "RetrievalModel"]] = {}


def register(table: dict[str, Any], kind: str, name: str) -> Callable:
    """A decorator that enters its object into the registry ``table`` (models, similarities, losses)
    under ``name``; a duplicate name is an error."""
    def add(obj):
        if name in table:
            raise ValueError(f"{kind} {name!r} is registered twice")
        table[name] = obj
        return obj
    return add


def lookup(table: dict[str, Any], kind: str, name: str) -> Any:
    """The entry ``name`` of the registry ``table``; an unknown name lists the valid ones."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid choices: {', '.join(sorted(table))}")
    return table[name]


def register_model(name: str) -> Callable:
    """Register a model factory under ``name``; a duplicate name is an error."""
    return register(_MODELS, "model", name)


class RetrievalModel(nn.Module):
    """Base class: subclasses set ``image_input`` and implement the three encode/score methods."""

    #: which feature layout the model reads: "global" (N, D), "grid" (N, G, G, C), "regions" (N, K, C)
    image_input: str = "global"
    #: True when ``score`` is a function of each pair jointly (SMAN, SAF, SGR)
    pairwise: bool = False
    #: True when a training step leaves some parameters without a gradient (a bias before a softmax
    #: that cancels it): data-parallel training then has DDP look for them after every backward
    unused_parameters: bool = False

    def encode_images(self, feats: torch.Tensor, counts: torch.Tensor | None = None) -> Any:
        raise NotImplementedError

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> Any:
        raise NotImplementedError

    def score(self, img: Any, cap: Any) -> torch.Tensor:
        """Similarities of every image with every caption: (n_img, n_cap)."""
        raise NotImplementedError

    def extra_loss(self, img: Any, cap: Any, scores: torch.Tensor) -> torch.Tensor | None:
        """Model-specific loss terms added to the ranking loss (default none)."""
        return None
