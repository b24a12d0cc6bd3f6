"""UVS / VSE++ / Order-embedding models: linear image encoder + GRU caption encoder.

Papers: Kiros et al. 2014 (UVS), Faghri et al. 2018 (VSE++), Vendrov et al. 2016 (order embeddings),
and their use over Full-Network Embeddings (Vilalta et al., Table 1: SH/MH/SOE/MOE/PH/POE).
``vse`` scores by cosine, ``order`` by the order violation ``-||max(0, c - i)||^2`` with ``|.|``
embeddings; either can take the other similarity through ``similarity=``, and ``order-norm`` is
VSE++'s order score ``-||max(0, c - i)||`` (presets ``order0`` / ``order++``).

Deviation kept: the image map has no bias (the VSE++ and order-embedding codes have one, zero at
start); initialisation otherwise as VSE++'s code (Xavier-uniform map, embeddings U(-0.1, 0.1)).
"""

from __future__ import annotations

import math

import torch

from .base import RetrievalModel, register_model
from .encoders import GRUTextEncoder, ImageEncoder
from .losses import similarity as similarity_fn


class EmbeddingModel(RetrievalModel):
    """Images and captions as vectors in one joint space, scored by ``similarity``."""

    image_input = "global"

    def __init__(self, img_encoder: torch.nn.Module, txt_encoder: torch.nn.Module, similarity: str):
        super().__init__()
        self.img_enc, self.txt_enc = img_encoder, txt_encoder
        self.similarity = similarity
        self._sim = similarity_fn(similarity)

    def encode_images(self, feats: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
        return self.img_enc(feats.flatten(1))

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor):
        return self.txt_enc(tokens, lengths)

    def score(self, img, cap) -> torch.Tensor:
        return self._sim(img, cap)


@register_model("vse")
def vse(img_shape, vocab_size: int, embed_dim: int = 1024, word_dim: int = 300,
        similarity: str = "cosine", use_abs: bool = False) -> EmbeddingModel:
    """Linear image encoder + GRU text encoder (UVS / VSE++); cosine by default."""
    return EmbeddingModel(ImageEncoder(int(math.prod(img_shape)), embed_dim, use_abs),
                          GRUTextEncoder(vocab_size, word_dim, embed_dim, use_abs), similarity)


@register_model("order")
def order(img_shape, vocab_size: int, embed_dim: int = 1024, word_dim: int = 300,
          similarity: str = "order", use_abs: bool = True) -> EmbeddingModel:
    """The same encoders scored by order violation with ``|.|`` embeddings (Order / Order++)."""
    return vse(img_shape, vocab_size, embed_dim, word_dim, similarity, use_abs)
