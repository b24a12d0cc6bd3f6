"""SMAN: stacked multi-modal attention over a 7x7 grid of cells (Ji et al.).

Paper: Ji, Wang, Han, Pang, "SMAN: Stacked Multimodal Attention Network for Cross-Modal Image-Text
Retrieval", IEEE Trans. Cybernetics 2020, Sec. III (step 0, intra-modal, multi-modal attention, the
fusion gate and the loss); the issue's wording of the equations is followed.

- Image: the M = G*G cells I_m (C = 2048) in row-major spatial order.  Text: BiLSTM over word
  embeddings, S_l = mean of the forward and backward states.  Hidden size H (512).
- Step 0: v_glo = tanh(P0 mean_m I_m); v_loc = mean_m GRU(I_1..I_M)_m; v0 = v_glo + v_loc;
  t0 = mean_l S_l.
- Step k (1: intra-modal, queries v0 / t0; 2: multi-modal, queries o_v / o_t, own weights):
  h_m = tanh(W_v I_m) * tanh(W_vq q_v), alpha = softmax_m(W_vh h_m), v_k = tanh(P_k (1/M) sum alpha I);
  h_l = tanh(W_t S_l) * tanh(W_tq q_t), a = softmax_l(W_th h_l) (padding masked), t_k = sum a S.
- Fusion gate: v^ = U_v(v0 + v1), t^ = U_t(t0 + t1), o_v = sigmoid(a v^ + (1-a) t^),
  o_t = sigmoid(a t^ + (1-a) v^), a = 0.9.  With a < 1, o_v mixes in the caption, so v2 / t2 belong
  to the pair and ``score`` is pairwise (batched: the attention logits of a block are one bmm).
- Similarity d = sum_k cos(v_k, t_k).
- Loss: the trainer's hinge on the hardest negatives (m1 = 0.2) plus ``extra_loss``, the intra-pair
  term lambda * sum_i max(0, delta_ii - m2), m2 = 0.25.  The paper writes it with the similarity d,
  which would push matching pairs *apart*; we use the DISTANCE delta = mean_k (1 - cos(v_k, t_k)) =
  1 - d / n_levels (in [0, 2]), so the term pulls every matching pair to within m2 of each other.

Ablations: SMAN-IM (step 1 only, no v_loc), SMAN-IM-LOC (step 1 only, with v_loc), SMAN-SIM (a = 1:
no cross-modal information, per-item embeddings scored by a matrix product), SMAN-inter
(``intra_pair=False``: no intra-pair term).  Dropout (0.3) is applied to the cells and the word
embeddings.  Sec. IV-A-3 sets every hidden embedding, the word embedding included, to 512 and
initialises the word embeddings with Xavier; both are the defaults here.

Deviation kept: the intra-pair term on a distance, not the similarity (Sec. III-D, see above).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import RetrievalModel
from . import sgraf
from .sgraf import bidirectional_states, masked_softmax, variant_factory


class CellAttention(nn.Module):
    """One image attention step: query-guided softmax over cells, then tanh(P (1/M) sum alpha I)."""

    def __init__(self, img_dim: int, hidden: int):
        super().__init__()
        self.key = nn.Linear(img_dim, hidden)      # W_v
        self.query = nn.Linear(hidden, hidden)     # W_vq
        self.logit = nn.Linear(hidden, 1)          # W_vh
        self.out = nn.Linear(img_dim, hidden)      # P_k

    def forward(self, cells: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Per item: cells (B, M, C), q (B, H) -> (B, H)."""
        h = torch.tanh(self.key(cells)) * torch.tanh(self.query(q))[:, None, :]
        alpha = torch.softmax(self.logit(h).squeeze(-1), dim=1)
        return torch.tanh(self.out((alpha[..., None] * cells).sum(1) / cells.shape[1]))

    def precompute(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-image parts of a pairwise step: tanh(W_v I) * w_vh and P_k I without bias."""
        keys = torch.tanh(self.key(cells)) * self.logit.weight[0]
        return keys, cells @ self.out.weight.t()

    def pairwise(self, keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """keys, values (n_i, M, H), q (n_i, n_c, H) -> (n_i, n_c, H), one bmm per product."""
        logits = torch.bmm(torch.tanh(self.query(q)), keys.transpose(1, 2))  # (n_i, n_c, M)
        alpha = torch.softmax(logits, dim=-1)
        return torch.tanh(torch.bmm(alpha, values) / keys.shape[1] + self.out.bias)


class WordAttention(nn.Module):
    """One text attention step: query-guided masked softmax over words, t = sum a S."""

    def __init__(self, hidden: int):
        super().__init__()
        self.key = nn.Linear(hidden, hidden)       # W_t
        self.query = nn.Linear(hidden, hidden)     # W_tq
        self.logit = nn.Linear(hidden, 1)          # W_th

    def forward(self, states: torch.Tensor, mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Per item: states (B, L, H), mask (B, L), q (B, H) -> (B, H)."""
        h = torch.tanh(self.key(states)) * torch.tanh(self.query(q))[:, None, :]
        a = masked_softmax(self.logit(h).squeeze(-1), mask, dim=1)
        return (a[..., None] * states).sum(1)

    def precompute(self, states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.key(states)) * self.logit.weight[0]

    def pairwise(self, keys, states, mask, q) -> torch.Tensor:
        """keys, states (n_c, L, H), mask (n_c, L), q (n_i, n_c, H) -> (n_i, n_c, H)."""
        logits = torch.bmm(torch.tanh(self.query(q)).transpose(0, 1), keys.transpose(1, 2))  # (n_c, n_i, L)
        a = masked_softmax(logits, mask[:, None, :].expand_as(logits), dim=-1)
        return torch.bmm(a, states).transpose(0, 1)


class SMAN(RetrievalModel):
    """SMAN and its ablations; encodings are tuples of batch-first tensors."""

    image_input = "grid"
    pairwise = True

    def __init__(self, vocab_size: int, img_dim: int = 2048, embed_dim: int = 512, word_dim: int = 512,
                 dropout: float = 0.3, alpha: float = 0.9, steps: int = 2, use_loc: bool = True,
                 intra_pair: bool = True, intra_weight: float = 1.0, intra_margin: float = 0.25):
        super().__init__()
        if steps not in (1, 2):
            raise ValueError(f"SMAN steps must be 1 or 2, got {steps}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"SMAN fusion alpha must be in [0, 1], got {alpha}")
        hidden = embed_dim
        self.steps, self.alpha, self.use_loc = steps, float(alpha), use_loc
        self.intra_pair, self.intra_weight, self.intra_margin = intra_pair, intra_weight, intra_margin
        # pairwise only when step 2 exists and its queries mix the two modalities
        self.pairwise = steps == 2 and self.alpha < 1.0
        # the pairwise step 2 reads only W_vh's and W_th's weights: their biases cancel in the softmax
        self.unused_parameters = self.pairwise
        self.drop = nn.Dropout(dropout)
        self.glo = nn.Linear(img_dim, hidden)                         # P0
        self.cell_gru = nn.GRU(img_dim, hidden, batch_first=True) if use_loc else None
        self.embed = nn.Embedding(vocab_size, word_dim)
        nn.init.xavier_uniform_(self.embed.weight)                    # as the SMAN paper, Sec. IV-A-3
        self.lstm = nn.LSTM(word_dim, hidden, batch_first=True, bidirectional=True)
        self.img_att = nn.ModuleList(CellAttention(img_dim, hidden) for _ in range(steps))
        self.txt_att = nn.ModuleList(WordAttention(hidden) for _ in range(steps))
        if steps == 2:
            self.fuse_v = nn.Linear(hidden, hidden)                   # U_v
            self.fuse_t = nn.Linear(hidden, hidden)                   # U_t

    # -- encoders --------------------------------------------------------------------------------
    def encode_images(self, feats: torch.Tensor, counts: torch.Tensor | None = None):
        """(B, G, G, C) or (B, M, C) cells -> a tuple of per-image tensors."""
        cells = self.drop(feats.to(self.glo.weight.dtype).flatten(1, -2))
        v0 = torch.tanh(self.glo(cells.mean(1)))
        if self.cell_gru is not None:
            v0 = v0 + self.cell_gru(cells)[0].mean(1)
        v1 = self.img_att[0](cells, v0)
        if self.steps == 1:
            return (torch.cat([F.normalize(v0, dim=-1), F.normalize(v1, dim=-1)], dim=-1),)
        v_hat = self.fuse_v(v0 + v1)
        if not self.pairwise:  # SMAN-SIM: o_v = sigmoid(v^)
            v2 = self.img_att[1](cells, torch.sigmoid(v_hat))
            return (torch.cat([F.normalize(v, dim=-1) for v in (v0, v1, v2)], dim=-1),)
        keys, values = self.img_att[1].precompute(cells)
        return F.normalize(v0, dim=-1), F.normalize(v1, dim=-1), v_hat, keys, values

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor):
        """(B, L) token ids and lengths -> a tuple of per-caption tensors."""
        states, mask, lengths = bidirectional_states(self.lstm, self.drop(self.embed(tokens.long())), lengths)
        t0 = states.sum(1) / lengths[:, None].to(states.dtype)
        t1 = self.txt_att[0](states, mask, t0)
        if self.steps == 1:
            return (torch.cat([F.normalize(t0, dim=-1), F.normalize(t1, dim=-1)], dim=-1),)
        t_hat = self.fuse_t(t0 + t1)
        if not self.pairwise:
            t2 = self.txt_att[1](states, mask, torch.sigmoid(t_hat))
            return (torch.cat([F.normalize(t, dim=-1) for t in (t0, t1, t2)], dim=-1),)
        keys = self.txt_att[1].precompute(states)
        return F.normalize(t0, dim=-1), F.normalize(t1, dim=-1), t_hat, keys, states, mask

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, img, cap) -> torch.Tensor:
        """d = sum_k cos(v_k, t_k) for every image x caption pair: (n_img, n_cap).

        Without autograd (evaluation) the pairs are scored in sub-blocks of at most
        ``sgraf.SCORE_BLOCK_ELEMENTS`` floats per intermediate (``sgraf.CAPTION_GROUP`` captions x
        as many images as fit), so a block's step-2 attention never streams an (images x captions x hidden) tensor
        through memory; the scores are the same (2.5x the pairs/s of the whole-block form at paper
        dims, bench/pairwise.py).
        """
        if not self.pairwise:
            return img[0] @ cap[0].t()
        if torch.is_grad_enabled():
            return self._score_block(img, cap)
        n_img, n_cap, hidden = img[0].shape[0], cap[0].shape[0], img[0].shape[1]
        budget = sgraf.block_budget(img[0].device)
        cap_step = min(n_cap, sgraf.CAPTION_GROUP)
        img_step = max(1, budget // (cap_step * max(hidden, img[3].shape[1], cap[3].shape[1])))
        out = img[0].new_empty(n_img, n_cap)
        for b in range(0, n_cap, cap_step):
            sub_cap = tuple(t[b:b + cap_step] for t in cap)
            for a in range(0, n_img, img_step):
                out[a:a + img_step, b:b + cap_step] = self._score_block(tuple(t[a:a + img_step] for t in img), sub_cap)
        return out

    def _score_block(self, img, cap) -> torch.Tensor:
        v0, v1, v_hat, v_keys, v_values = img
        t0, t1, t_hat, t_keys, t_states, t_mask = cap
        o_v = torch.sigmoid(self.alpha * v_hat[:, None, :] + (1 - self.alpha) * t_hat[None, :, :])
        o_t = torch.sigmoid(self.alpha * t_hat[None, :, :] + (1 - self.alpha) * v_hat[:, None, :])
        v2 = self.img_att[1].pairwise(v_keys, v_values, o_v)
        t2 = self.txt_att[1].pairwise(t_keys, t_states, t_mask, o_t)
        return v0 @ t0.t() + v1 @ t1.t() + F.cosine_similarity(v2, t2, dim=-1, eps=1e-8)

    def extra_loss(self, img, cap, scores: torch.Tensor) -> torch.Tensor | None:
        """lambda * sum_i max(0, delta_ii - m2), delta = 1 - d / n_levels (positives on the diagonal)."""
        if not self.intra_pair or self.intra_weight == 0:
            return None
        distance = 1.0 - scores.diagonal() / (self.steps + 1)   # steps + 1 levels of cosines
        return self.intra_weight * (distance - self.intra_margin).clamp(min=0).sum()


def _variant(name: str, doc: str, **fixed):
    return variant_factory(SMAN, name, "grid", (7, 7, 2048), doc, **fixed)


sman = _variant("sman", "Full SMAN: steps 0-2, v_loc, fusion gate alpha 0.9, intra-pair term.")
sman_im = _variant("sman-im", "SMAN-IM: intra-modal step 1 only, no v_loc.", steps=1, use_loc=False)
sman_im_loc = _variant("sman-im-loc", "SMAN-IM-LOC: intra-modal step 1 only, with v_loc.", steps=1, use_loc=True)
sman_sim = _variant("sman-sim", "SMAN-SIM: alpha = 1, no cross-modal information; per-item embeddings, "
                    "matrix-product scores.", alpha=1.0)
sman_inter = _variant("sman-inter", "SMAN-inter: full SMAN without the intra-pair loss term.", intra_pair=False)
