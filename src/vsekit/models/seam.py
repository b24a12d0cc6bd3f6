"""SEAM-E / SEAM-C / SEAM-G: self-attentive caption encoders (Wehrmann et al., SEAM).

The caption side is ``SeamTextEncoder`` (see encoders.py); the image side the same linear map as
VSE. SEAM's loss is the order-violation hinge plus ``lambda * ||A A^T - I||_F^2`` (Lin et al. eq. 8),
squared, averaged over the batch and really added to the loss through ``extra_loss`` (the public SEAM
code computes it but never adds it). Paper settings (presets ``seam-e``/``seam-c``/``seam-g``): word
dim and attention units 300, hops 30 (E), 10 per module (C), 30 over a 512-unit GRU (G), lambda 0.5,
joint space 1024, order loss with margin 0.05 and ``|.|``; every caption per epoch and gradient
clip 1, and Xavier-uniform linear maps and convolutions, as the reference code.

Deviations kept: the penalty is added to the loss (as the paper writes it; the code leaves it
out); the order score is the squared violation (``order``) of the order-embedding paper.
"""

from __future__ import annotations

import math

import torch

from .base import register_model
from .encoders import ImageEncoder, SeamTextEncoder
from .vse import EmbeddingModel


class SeamModel(EmbeddingModel):
    """Captions encode to (embedding, per-caption penalty); ``extra_loss`` is lambda x mean penalty."""

    def __init__(self, img_encoder, txt_encoder, similarity: str, penalty_weight: float):
        super().__init__(img_encoder, txt_encoder, similarity)
        self.penalty_weight = float(penalty_weight)

    def score(self, img, cap) -> torch.Tensor:
        return self._sim(img, cap[0])

    def extra_loss(self, img, cap, scores):
        if self.penalty_weight == 0:
            return None
        return self.penalty_weight * cap[1].mean()


def _factory(variant: str, default_hops: int):
    def make(img_shape, vocab_size: int, embed_dim: int = 1024, word_dim: int = 300,
             similarity: str = "order", use_abs: bool = True, hops: int = default_hops,
             att_units: int = 300, filters: int = 100, gru_dim: int = 512,
             penalty_weight: float = 0.5) -> SeamModel:
        img = ImageEncoder(int(math.prod(img_shape)), embed_dim, use_abs)
        txt = SeamTextEncoder(variant, vocab_size, word_dim, embed_dim, hops=hops, att_units=att_units,
                              filters=filters, gru_dim=gru_dim, use_abs=use_abs)
        return SeamModel(img, txt, similarity, penalty_weight)
    make.__doc__ = f"SEAM-{variant.upper()} caption encoder + linear image encoder, order loss by default."
    return make


register_model("seam-e")(_factory("e", 30))
register_model("seam-c")(_factory("c", 10))
register_model("seam-g")(_factory("g", 30))
