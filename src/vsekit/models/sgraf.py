"""SAF and SGR similarity models on region features (SGRAF), with a replaceable global module.

Paper: Diao, Zhang, Ma, Lu, "Similarity Reasoning and Filtration for Image-Text Matching" (AAAI 2021),
Sec. 3.1-3.3; the T-EMDE global module is in ``temde.py``.

- Image: K regions (C) -> linear to d (1024) -> l2norm.  Text: embedding 300, dropout 0.4, BiGRU d,
  forward and backward states averaged, l2norm.
- Global node (self-attention, eq. 2-4): l = tanh(BN(W_l V)), g = tanh(BN(W_g mean V)),
  w = softmax_k(w_c (l * g)), v_glo = l2norm(sum w V); the same for words without BN;
  sim_glo = l2norm(W_sg (v_glo - t_glo)^2).
- Local nodes (eq. 5-6): s = LeakyReLU_0.1(V U^T), l2norm over words, alpha = softmax_k(9 s),
  a_t = l2norm(sum_k alpha v_k), sim_t = l2norm(W_sl (a_t - u_t)^2).
- SGR (eq. 7-8): N = [sim_glo; sim_1..L]; three steps E = softmax(W_q N (W_k N)^T), N <- ReLU(W_g E N),
  separate weights per step; score = sigmoid(w . N_glo).
- SAF (eq. 9): a = l1norm(sigmoid(BN(w . N))), score = sigmoid(w' . l2norm(sum a N)); in training
  the BN statistics are per caption (over its images x nodes) and the running estimates move once
  per caption, as the reference code's one BN call per caption (:class:`CaptionBatchNorm1d`).

``global_module`` is "self-attention" (the paper), "t-emde" or "none" (no global node; SGR then reads
out the mean of the reasoned local nodes, SAF filters the local nodes only). Variable region counts
and caption lengths are masked everywhere (softmaxes, BN statistics, the l2norm over words, the graph
edges and the SAF weights), so padding never changes a score. Initialisation as the reference code:
Xavier-uniform linear maps with zero biases, word embeddings U(-0.1, 0.1).

Deviation kept: the reference code's region ``BatchNorm1d(36)`` normalises per region slot; here BN
normalises per channel over the real regions (Sec. 3.1's equations; any region count works).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .base import RetrievalModel, register_model
from .encoders import l2norm, length_mask, softmax_short_rows  # noqa: F401 (re-exported for sman/temde)
from .sync import current as current_sync
from .temde import MaskedBatchNorm1d, TEMDEGlobal

GLOBAL_MODULES = ("self-attention", "t-emde", "none")
# Largest (images x captions x words x dim) tensor ``score`` builds at once when no gradient is kept:
# on a CPU 2^22 floats (16 MB), half glibc's largest mmap threshold, so with ``vsekit.allocator``'s
# tuning every temporary is reused from the heap (bench/pairwise.py, paper dims: 2^20 6.5k pairs/s,
# 2^22 8.5k, 2^23 8.7k); accelerators get bigger blocks.
SCORE_BLOCK_ELEMENTS = 1 << 22
SCORE_BLOCK_ELEMENTS_ACCELERATOR = 1 << 24
# Captions scored together when evaluating, grouped by length (so each group carries little padding).
CAPTION_GROUP = 32
# Largest (images x captions x dim) block of global similarity nodes formed at once in evaluation.
GLOBAL_BLOCK_ELEMENTS = 1 << 22


# On CUDA a sub-block's largest tensor gets this fraction of the free device memory (a sub-block
# holds about a dozen tensors of that size at once, forward and backward), within these bounds.
DEVICE_BUDGET_FRACTION = 1 / 32
DEVICE_BUDGET_MAX_ELEMENTS = 1 << 28


def block_budget(device) -> int:
    """Elements of the largest float tensor one scoring or training sub-block forms on ``device``.

    CPU: ``SCORE_BLOCK_ELEMENTS`` (cache and heap friendly, see above). CUDA: sized from the free
    device memory (``torch.cuda.mem_get_info``, read once per call; no stream synchronisation), at
    least ``SCORE_BLOCK_ELEMENTS_ACCELERATOR``. Other accelerators: the accelerator constant.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return SCORE_BLOCK_ELEMENTS
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        elements = int(free * DEVICE_BUDGET_FRACTION) // 4
        return max(SCORE_BLOCK_ELEMENTS_ACCELERATOR, min(DEVICE_BUDGET_MAX_ELEMENTS, elements))
    return SCORE_BLOCK_ELEMENTS_ACCELERATOR


def length_groups(lengths: list[int], per_word: int, budget: int) -> list[tuple[list[int], int]]:
    """Captions in groups of similar length, each cut to its own longest caption: ``[(indices, width)]``.

    ``lengths`` are host integers; captions are taken in increasing length (ties in their order) and
    a group grows while ``members x width x per_word`` stays within ``budget`` (at least one member).
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups, a = [], 0
    while a < len(order):
        b = a + 1
        while b < len(order) and (b - a + 1) * max(1, lengths[order[b]]) * per_word <= budget:
            b += 1
        groups.append((order[a:b], max(1, lengths[order[b - 1]])))
        a = b
    return groups


class _ResidualMap(torch.autograd.Function):
    """``W (c - u)^2 + b`` (eq. 6 before its l2norm) for contexts c (n_img, G, L, d), words u (G, L, d).

    Keeps only the difference ``c - u`` for backward; the squares are formed again there for W's
    gradient, in the buffer that then takes the input gradient ``2 (c - u) (g W)``. Plain autograd
    keeps the difference *and* the squares (two d-wide tensors per word and image) and forms three
    more of that size in ``pow``'s backward.
    """

    @staticmethod
    def forward(ctx, c: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        diff = c - u
        ctx.save_for_backward(diff, weight)
        return F.linear(diff * diff, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        diff, weight = ctx.saved_tensors
        d = diff.shape[-1]
        g = grad.reshape(-1, grad.shape[-1])
        buf = torch.mul(diff, diff).view(-1, d)
        grad_w = g.t() @ buf if ctx.needs_input_grad[2] else None
        grad_b = g.sum(0) if ctx.needs_input_grad[3] else None
        torch.mm(g, weight, out=buf)                     # the squares are no longer needed
        grad_c = buf.view(diff.shape).mul_(diff).mul_(2.0)
        grad_u = -grad_c.sum(0) if ctx.needs_input_grad[1] else None
        return grad_c, grad_u, grad_w, grad_b


def masked_softmax(logits: torch.Tensor, mask: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax over ``dim`` where ``mask`` is False gets exactly zero weight."""
    logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=dim) * mask.to(logits.dtype)


def bidirectional_states(rnn: nn.RNNBase, emb: torch.Tensor, lengths) -> tuple[torch.Tensor, ...]:
    """Run a bidirectional RNN over padded (B, L, E) inputs; average the two directions per word.

    Returns the states (zero at padding), the (B, L) mask of the real words and the lengths (at least
    1, at most L) on ``emb``'s device. Packing makes the backward direction start at each caption's
    last real word, so padding never reaches a real word's state. It packs with the caller's own
    lengths when they are on the host (the trainer keeps them there: no device round trip per batch).
    """
    width = emb.shape[1]
    on_device = as_lengths(lengths, emb.device).clamp(min=1, max=width)
    host = lengths if isinstance(lengths, torch.Tensor) and lengths.device.type == "cpu" else on_device
    packed = nn.utils.rnn.pack_padded_sequence(emb, host.detach().to("cpu", torch.int64).clamp(min=1, max=width),
                                               batch_first=True, enforce_sorted=False)
    out, _ = rnn(packed)
    out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=width)
    half = out.shape[-1] // 2
    return (out[..., :half] + out[..., half:]) / 2, length_mask(on_device, width), on_device


def as_lengths(lengths, device) -> torch.Tensor:
    return torch.as_tensor(lengths, device=device, dtype=torch.int64)


class CaptionBatchNorm1d(MaskedBatchNorm1d):
    """SAF's batch norm over (n_img, n_cap, nodes, C) logits, with one set of statistics per caption.

    The SGRAF reference scores a batch caption by caption and calls its ``BatchNorm1d(1)`` once per
    caption, over that caption's (images x nodes) logits; each call normalises with its own batch
    statistics and moves the running estimates one step (``r <- (1 - m) r + m x_c``, the variance
    unbiased). Computed here for all captions at once: in training each caption's logits are
    normalised by the (biased) mean and variance over its images and real nodes, and after the C
    captions of the block, in their order, the running estimates are the closed form of those C
    steps, ``r = (1 - m)^C r0 + sum_c m (1 - m)^(C - 1 - c) x_c``. Evaluation uses the running
    estimates, as the parent class. Same parameters and buffers as the parent (checkpoints load).
    """

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                statistics: list | None = None) -> torch.Tensor:
        """``statistics``: a list that receives this block's per-caption (mean, var, members) instead
        of the running estimates moving now (a caller scoring captions out of order applies them in
        the captions' order with :meth:`update_running`)."""
        if not self.training:
            return super().forward(x, mask)
        if x.dtype in (torch.float16, torch.bfloat16):   # statistics in float32 under autocast
            x = x.float()
        if mask is None:
            mask = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
        m = mask.to(x.dtype).unsqueeze(-1)
        n = m.sum((0, 2))                                             # (n_cap, 1) members per caption
        mean = (x * m).sum((0, 2)) / n.clamp(min=1)                   # (n_cap, C)
        var = ((x - mean[None, :, None]).pow(2) * m).sum((0, 2)) / n.clamp(min=1)
        if statistics is None:
            self._update_running(mean.detach(), var.detach(), n[:, 0])
        else:
            statistics.append((mean.detach(), var.detach(), n[:, 0]))
        y = (x - mean[None, :, None]) * torch.rsqrt(var[None, :, None] + self.eps) * self.weight + self.bias
        return y * m

    def update_running(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        """Move the running estimates by captions' statistics, one step per caption in their order.

        Data-parallel (a :mod:`~vsekit.models.sync` reducer installed), every rank's captions'
        statistics are gathered in rank order (the global batch's caption order: each rank holds a
        contiguous slice) and applied on every rank, so the buffers are those of one process."""
        sync = current_sync()
        if sync is not None:
            mean, var, n = (sync.gather_rows(t.detach()) for t in (mean, var, n))
        self._update_running(mean, var, n)

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, n: torch.Tensor) -> None:
        """The running estimates after one update per caption (captions without members skip theirs).

        Written without boolean indexing, so that on a GPU the update needs no host synchronisation.
        """
        if mean.shape[0] == 0:
            return
        dtype = self.running_mean.dtype
        kept = (n > 0).to(dtype)
        unbiased = torch.where((n > 1)[:, None], var * (n / (n - 1).clamp(min=1))[:, None], var)
        decay = 1.0 - self.momentum
        later = kept.flip(0).cumsum(0).flip(0) - kept          # kept captions after each caption
        weights = (self.momentum * kept * torch.pow(decay, later))[:, None]
        carry = torch.pow(decay, kept.sum())
        self.running_mean.copy_(carry * self.running_mean + (weights * mean.to(dtype)).sum(0))
        self.running_var.copy_(carry * self.running_var + (weights * unbiased.to(dtype)).sum(0))


class SelfAttention(nn.Module):
    """Global vector of a set's members (eq. 2-4): the image's regions with BN masked to the real
    regions (``bn``), the caption's words without BN."""

    def __init__(self, dim: int, dropout: float = 0.4, bn: bool = False):
        super().__init__()
        # registered in this order (the parameters' order: optimizer states of checkpoints)
        self.local = nn.Linear(dim, dim)
        self.local_bn = MaskedBatchNorm1d(dim) if bn else None
        self.glob = nn.Linear(dim, dim)
        self.glob_bn = MaskedBatchNorm1d(dim) if bn else None
        self.common = nn.Linear(dim, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.to(v.dtype)
        mean = (v * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1)
        local, glob = self.local(v), self.glob(mean)
        if self.local_bn is not None:
            local, glob = self.local_bn(local, mask), self.glob_bn(glob)
        l_emb = self.drop(torch.tanh(local))
        g_emb = self.drop(torch.tanh(glob))
        w = masked_softmax(self.common(l_emb * g_emb[:, None, :]).squeeze(-1), mask, dim=1)
        return l2norm((w[..., None] * v).sum(1))


class GraphReasoning(nn.Module):
    """One SGR step (eq. 7-8): N <- ReLU(W_g softmax(W_q N (W_k N)^T) N), masked keys.

    The edge logits are computed as ``(W_k^T (W_q n_i + b_q)) . n_j``: expanding
    ``(W_q n_i + b_q) . (W_k n_j + b_k)`` leaves, besides that, only terms constant over the keys j,
    which the softmax over j cancels exactly. So one (dim x dim) map per node replaces two, a third
    less work per reasoning step, with the same edges and the same parameters (W_q, b_q, W_k, b_k
    as in the paper; b_k receives no gradient, as in the literal form, where it cancels too). The
    steps run in :meth:`SGRAF._readout`.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.graph = nn.Linear(dim, dim)

    def probe_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight and bias of the merged map ``W_k^T (W_q n + b_q)`` (a dim^3 product to form)."""
        wk = self.key.weight
        return wk.t() @ self.query.weight, wk.t() @ self.query.bias


class SGRAF(RetrievalModel):
    """SAF or SGR over region features; ``score`` gives sigmoid similarities of every pair."""

    image_input = "regions"
    pairwise = True

    def __init__(self, vocab_size: int, img_dim: int = 2048, mode: str = "sgr", embed_dim: int = 1024,
                 word_dim: int = 300, sim_dim: int = 256, dropout: float = 0.4, sgr_steps: int = 3,
                 lambda_softmax: float = 9.0, global_module: str = "self-attention",
                 temde_divisions: int = 20, temde_centroids: int = 8, temde_dim: int = 8):
        super().__init__()
        if mode not in ("sgr", "saf"):
            raise ValueError(f"unknown SGRAF mode {mode!r}; valid choices: saf, sgr")
        if global_module not in GLOBAL_MODULES:
            raise ValueError(f"unknown --global-module {global_module!r}; valid choices: {', '.join(GLOBAL_MODULES)}")
        self.mode, self.global_module, self.lambda_softmax = mode, global_module, lambda_softmax
        self.img_fc = nn.Linear(img_dim, embed_dim)
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.word_drop = nn.Dropout(dropout)
        self.gru = nn.GRU(word_dim, embed_dim, batch_first=True, bidirectional=True)
        if global_module == "self-attention":
            self.v_att = SelfAttention(embed_dim, dropout, bn=True)
            self.t_att = SelfAttention(embed_dim, dropout)
            self.sim_glo_w = nn.Linear(embed_dim, sim_dim)
        elif global_module == "t-emde":
            self.temde = TEMDEGlobal(embed_dim, sim_dim, temde_divisions, temde_centroids, temde_dim)
        self.sim_loc_w = nn.Linear(embed_dim, sim_dim)
        if mode == "sgr":
            self.reasoning = nn.ModuleList(GraphReasoning(sim_dim) for _ in range(sgr_steps))
            self.unused_parameters = sgr_steps > 0     # b_k cancels in the edges' softmax
        else:
            self.saf_w = nn.Linear(sim_dim, 1)
            self.saf_bn = CaptionBatchNorm1d(1)
        self.eval_w = nn.Linear(sim_dim, 1)
        self._init_weights()

    def _init_weights(self) -> None:
        """As the SGRAF reference code: every linear map Xavier-uniform with a zero bias, word
        embeddings U(-0.1, 0.1); the GRU keeps torch's default, the T-EMDE module its own."""
        skip = set(self.temde.modules()) if self.global_module == "t-emde" else set()
        for m in self.modules():
            if isinstance(m, nn.Linear) and m not in skip:
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    # -- encoders: each returns (members (B, L, d), mask (B, L) bool, global (B, G)) ----------------
    def encode_images(self, feats: torch.Tensor, counts: torch.Tensor | None = None):
        feats = feats.to(self.img_fc.weight.dtype)   # float32 (float64 in the exactness tests)
        b, k = feats.shape[:2]
        if counts is None:
            mask = torch.ones(b, k, dtype=torch.bool, device=feats.device)
        else:
            mask = length_mask(as_lengths(counts, feats.device), k)
        v = l2norm(self.img_fc(feats)) * mask[..., None].to(feats.dtype)
        return v, mask, self._global(v, mask, image=True)

    def encode_captions(self, tokens: torch.Tensor, lengths: torch.Tensor):
        states, mask, _ = bidirectional_states(self.gru, self.word_drop(self.embed(tokens.long())), lengths)
        u = l2norm(states)   # padding stays zero
        return u, mask, self._global(u, mask, image=False)

    def _global(self, x, mask, image: bool):
        """The global vector of each image (its regions) or caption (its words); empty without one."""
        if self.global_module == "self-attention":
            return (self.v_att if image else self.t_att)(x, mask)
        if self.global_module == "t-emde":
            return (self.temde.image_coder if image else self.temde.text_coder)(x, mask)
        return x.new_zeros(x.shape[0], 0)

    # -- scoring ---------------------------------------------------------------------------------
    def score(self, img, cap) -> torch.Tensor:
        """(n_img, n_cap) similarities in batched tensor ops; without autograd, in bounded sub-blocks.

        Without autograd (evaluation) the captions are also grouped by length, and each group is
        cut to its own longest caption: a block padded to the longest caption of a whole batch
        would spend most of its work on padding (COCO captions: mean ~11 words, longest ~50).
        Padding never changes a score, so the result is the same. Each sub-block then goes through
        :meth:`_score_block_eval`, which computes the same scores as ``_score_train`` (used with
        autograd) with less work and fewer memory passes; tests compare the two.
        """
        if torch.is_grad_enabled() or (self.training and self.mode == "saf"):
            # SAF's training-mode BN needs each caption's logits over all images at once
            return self._score_train(img, cap)
        u, u_mask, u_glo = cap
        n_cap = u.shape[0]
        # the lengths and the grouping on the host, once (no device sync per caption group)
        lengths = u_mask.sum(1).tolist()
        order = sorted(range(n_cap), key=lengths.__getitem__)
        out = u.new_empty(img[0].shape[0], n_cap)
        # the merged edge maps, formed once here rather than in every cache-sized sub-block
        probes = [step.probe_map() for step in self.reasoning] if self.mode == "sgr" else None
        grams = torch.bmm(img[0], img[0].transpose(1, 2))   # region Gram matrices: context norms
        budget = block_budget(u.device)
        all_regions = bool(img[1].all())
        order_on_device = torch.as_tensor(order, device=u.device)     # one copy to the device
        for a in range(0, n_cap, CAPTION_GROUP):
            members = order[a:a + CAPTION_GROUP]
            width = max(1, max(lengths[i] for i in members))
            idx = order_on_device[a:a + CAPTION_GROUP]
            group = (u[idx, :width], u_mask[idx, :width], u_glo[idx])
            out[:, idx] = self._score_images(img, group, probes, grams, budget, all_regions)
        return out

    def _score_images(self, img, cap, probes, grams, budget, all_regions) -> torch.Tensor:
        """All images against one caption group, in image sub-blocks of bounded size.

        The global nodes are formed for many images at once (up to GLOBAL_BLOCK_ELEMENTS), since
        a cache-sized sub-block holds too few images for their products to run efficiently.
        """
        n_img, regions = img[0].shape[:2]
        n_cap, words, dim = cap[0].shape
        per_image = max(1, n_cap * words * max(dim, regions))
        step = max(1, budget // per_image)
        chunk = max(step, GLOBAL_BLOCK_ELEMENTS // max(1, n_cap * max(dim, self.sim_loc_w.out_features)))
        out = []
        for a in range(0, n_img, chunk):
            end = min(a + chunk, n_img)
            glo = self.global_node(img[2][a:end], cap[2])
            for i in range(a, end, step):
                j = min(i + step, end)      # a sub-block never runs past its chunk's global nodes
                sub = tuple(t[i:j] for t in img)
                out.append(self._score_block_eval(sub, cap, probes, grams[i:j],
                                                  None if glo is None else glo[i - a:j - a], all_regions))
        return out[0] if len(out) == 1 else torch.cat(out, dim=0)

    def global_node(self, v_glo, u_glo) -> torch.Tensor | None:
        if self.global_module == "self-attention":
            return l2norm(self.sim_glo_w((v_glo[:, None, :] - u_glo[None, :, :]).pow(2)))
        if self.global_module == "t-emde":
            return self.temde.pair(v_glo, u_glo)
        return None

    # -- training: the scores and their gradients, in bounded sub-blocks ----------------------------
    def _score_train(self, img, cap) -> torch.Tensor:
        """The scores of eq. 5-9 (and, through autograd, their gradients) in caption sub-blocks.

        Every sub-block holds a group of captions against all images, so SAF's per-caption batch
        statistics are those of the whole block; its running estimates move once per caption in
        the captions' order, after the last group. Per sub-block:

        - ``W_sl (c - u)^2`` through :class:`_ResidualMap`, which keeps one d-wide tensor per word
          and image (the difference) where autograd would keep two and form three more in
          backward; the attention before it keeps only K-wide tensors (K regions against d dims),
          so recomputing it in backward (checkpointing) would cost two K x d products per word to
          save little memory, and is not done;
        - context norms from the region Gram matrices (as evaluation), SGR's merged edge maps formed
          once per call, the graph masks as one additive bias, and SGR's last step on the global
          row only (the score reads that row alone);
        - on a CPU the captions are grouped by length and each group cut to its longest caption.

        Sub-blocks are sized from :func:`block_budget`, so each tensor stays small enough to be
        reused from the heap (CPU) and a batch of 128 fits (GPU).
        """
        v, v_mask, v_glo = img
        u, u_mask, u_glo = cap
        n_img, k, d = v.shape
        n_cap, width = u.shape[:2]
        budget = block_budget(v.device)
        if v.device.type == "cpu":
            groups = length_groups(u_mask.sum(1).tolist(), n_img * max(d, k), budget)
        else:   # no host round trip on an accelerator: batch order, the batch's width
            per = max(1, width * n_img * max(d, k))
            step = max(1, budget // per)
            groups = [(list(range(a, min(a + step, n_cap))), width) for a in range(0, n_cap, step)]
        grams = torch.bmm(v, v.transpose(1, 2)) if d > 2 * k else None
        missing = torch.zeros(v_mask.shape, dtype=v.dtype, device=v.device)
        missing.masked_fill_(~v_mask, torch.finfo(v.dtype).min)
        probes = [step.probe_map() for step in self.reasoning] if self.mode == "sgr" else None
        statistics: list | None = [] if self.mode == "saf" and self.saf_bn.training else None
        autocast = torch.is_autocast_enabled(v.device.type)
        cols, order = [], []
        for members, w in groups:
            if members == list(range(members[0], members[-1] + 1)):
                idx = slice(members[0], members[-1] + 1)     # a view; no index copied to the device
            else:
                idx = torch.as_tensor(members, device=u.device)
            u_g, m_g = u[idx, :w], u_mask[idx, :w]
            context = self._contexts(v, grams, missing, u_g, m_g)
            if autocast:   # mixed precision: autograd's own ops, which autocast knows how to cast
                nodes = l2norm(self.sim_loc_w((context - u_g).pow(2)))
            else:
                nodes = l2norm(_ResidualMap.apply(context, u_g, self.sim_loc_w.weight, self.sim_loc_w.bias))
            glo = self.global_node(v_glo, u_glo[idx])
            cols.append(self._reason(nodes, m_g, glo, probes, statistics))
            order += members
        scores = cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)
        if order != list(range(n_cap)):
            inverse = torch.empty(n_cap, dtype=torch.int64)
            inverse[torch.as_tensor(order)] = torch.arange(n_cap)
            inverse = inverse.to(scores.device)
            scores = scores.index_select(1, inverse)
        else:
            inverse = None
        if statistics:
            mean, var, n = (torch.cat(t) for t in zip(*statistics))
            if inverse is not None:
                mean, var, n = mean[inverse], var[inverse], n[inverse]
            self.saf_bn.update_running(mean, var, n)
        return scores

    def _contexts(self, v, grams, missing, u, u_mask) -> torch.Tensor:
        """The attended contexts ``c_t`` of eq. 6 for every image and word of a caption group: (n_img, G, L, d),
        the same with autograd (training) and without (evaluation).

        The local nodes up to ``W_sl``: attention ``s = LeakyReLU(V U^T)`` masked to the real words,
        l2-normalised over the words and scaled by lambda, softmax over the real regions, and the
        l2-normalised context ``c = V^T alpha``; its norm from the Gram matrix ``V V^T`` when given
        (``|c|^2 = alpha^T V V^T alpha``), so the d-wide context is formed already normalised.
        """
        n_img, k, d = v.shape
        g, w = u.shape[:2]
        p = g * w
        eps = 1e-8
        attn = (v.reshape(n_img * k, d) @ u.reshape(p, d).t()).view(n_img, k, g, w)
        attn = F.leaky_relu(attn, 0.1) * u_mask.view(1, 1, g, w).to(attn.dtype)
        attn = l2norm(attn, dim=-1) * self.lambda_softmax
        if missing is not None:   # None: every region is real
            attn = attn + missing.view(n_img, k, 1, 1)
        alpha = torch.softmax(attn, dim=1).view(n_img, k, p)           # over the real regions
        if grams is not None:
            sq_norm = (torch.bmm(grams, alpha) * alpha).sum(1)         # |V^T alpha|^2, (n_img, p)
            alpha = alpha * sq_norm.clamp_min(eps * eps).rsqrt()[:, None, :]
            context = torch.bmm(alpha.transpose(1, 2), v)
        else:
            context = l2norm(torch.bmm(alpha.transpose(1, 2), v))
        return context.view(n_img, g, w, d)

    def _reason(self, nodes, u_mask, glo, probes, statistics) -> torch.Tensor:
        """Scores (n_img, G) of a group's local nodes (n_img, G, L, sim) with its global nodes (or None)."""
        if glo is not None:
            nodes = torch.cat([glo[:, :, None, :], nodes], dim=2)
            u_mask = torch.cat([u_mask.new_ones(u_mask.shape[0], 1), u_mask], dim=1)
        return self._readout(nodes, u_mask, glo is not None, probes, statistics)

    def _readout(self, nodes, u_mask, has_glo: bool, probes, statistics=None) -> torch.Tensor:
        """Scores (n_img, G) of nodes (n_img, G, N, sim), the global node first when ``has_glo``:
        SAF's filtration, or SGR's steps with the graph masks as one additive bias and the last step
        on the global row only (the score reads that row alone; the other nodes' last update, two
        dim x dim maps per node, is never needed). Without autograd the softmaxes run in place."""
        n_img, g, n, dim = nodes.shape
        if self.mode == "saf":
            out = self._filtered(nodes, u_mask[None].expand(n_img, -1, -1), statistics)
            return torch.sigmoid(self.eval_w(out)).squeeze(-1)
        softmax = (lambda x: torch.softmax(x, dim=-1)) if torch.is_grad_enabled() else softmax_short_rows
        b = n_img * g
        nodes = nodes.reshape(b, n, dim)
        bias = torch.zeros(g, n, dtype=nodes.dtype, device=nodes.device)
        bias.masked_fill_(~u_mask, torch.finfo(nodes.dtype).min)
        bias = bias.expand(n_img, g, n).reshape(b, 1, n)
        steps = list(zip(self.reasoning, probes))
        last = len(steps) - 1 if has_glo and steps else len(steps)
        for step, (weight, pbias) in steps[:last]:
            # (a batched product with a transposed operand runs ~2x slower than copy + product)
            edges = torch.bmm(F.linear(nodes, weight, pbias), nodes.transpose(1, 2).contiguous()).add_(bias)
            nodes = F.relu_(step.graph(torch.bmm(softmax(edges), nodes)))
        if has_glo and steps:                                    # the last step, global row only
            step, (weight, pbias) = steps[-1]
            probe = F.linear(nodes[:, 0], weight, pbias)
            edges = softmax(torch.bmm(nodes, probe[:, :, None]).squeeze(-1).add_(bias[:, 0]))
            out = F.relu_(step.graph(torch.bmm(edges[:, None, :], nodes).squeeze(1)))
        elif has_glo:
            out = nodes[:, 0]
        else:
            m = u_mask[None].expand(n_img, -1, -1).reshape(b, n, 1).to(nodes.dtype)
            out = (nodes * m).sum(1) / m.sum(1).clamp(min=1)
        return torch.sigmoid(self.eval_w(out)).squeeze(-1).view(n_img, g)

    def _filtered(self, nodes: torch.Tensor, mask: torch.Tensor, statistics: list | None = None) -> torch.Tensor:
        """SAF (eq. 9): l2norm(sum_i a_i N_i), a = l1norm(sigmoid(BN(w . N))) over the real nodes."""
        if statistics is not None:
            logits = self.saf_bn(self.saf_w(nodes), mask, statistics).squeeze(-1)
        else:
            logits = self.saf_bn(self.saf_w(nodes), mask).squeeze(-1)
        a = torch.sigmoid(logits) * mask.to(nodes.dtype)
        a = a / (a.sum(-1, keepdim=True) + 1e-8)
        return l2norm((a[..., None] * nodes).sum(2))

    # -- evaluation: the same scores as ``_score_train``, with less work and fewer memory passes ---
    def _local_nodes_eval(self, v, v_mask, u, u_mask, grams, out, all_regions=False) -> None:
        """The local nodes of :meth:`_contexts` and ``W_sl`` without autograd, written into ``out``
        (n_img, n_cap, L, sim_dim); ``(c - u)^2`` is formed in place of the contexts."""
        n_img, k, d = v.shape
        missing = None if all_regions else v.new_zeros(v_mask.shape).masked_fill_(~v_mask, torch.finfo(v.dtype).min)
        # the Gram form of the context norms costs K^2 per word, the direct norm a pass over d
        context = self._contexts(v, grams if d > 2 * k else None, missing, u, u_mask)
        context.view(n_img, -1).sub_(u.reshape(1, -1)).square_()
        sims = torch.addmm(self.sim_loc_w.bias, context.view(-1, d), self.sim_loc_w.weight.t())
        sims.div_(torch.linalg.vector_norm(sims, dim=-1, keepdim=True).clamp_min_(1e-8))
        out.copy_(sims.view(out.shape))

    def _score_block_eval(self, img, cap, probes, grams, glo, all_regions=False) -> torch.Tensor:
        """``_score_train``'s scores for evaluation (no autograd), the local nodes from
        :meth:`_local_nodes_eval`, written into one preallocated node tensor, then :meth:`_readout`."""
        v, v_mask = img[:2]
        u, u_mask = cap[:2]
        n_img, n_cap, n_words = v.shape[0], u.shape[0], u.shape[1]
        first = 0 if glo is None else 1
        nodes = v.new_empty(n_img, n_cap, first + n_words, self.sim_loc_w.out_features)
        if glo is not None:
            nodes[:, :, 0] = glo
            u_mask = torch.cat([u_mask.new_ones(n_cap, 1), u_mask], dim=1)
        self._local_nodes_eval(v, v_mask, u, cap[1], grams, nodes[:, :, first:], all_regions)
        return self._readout(nodes, u_mask, glo is not None, probes)


def img_dim_of(img_shape, expect: str, model: str) -> int:
    """The channel width of a feature row shape; refuses a layout the model cannot read."""
    shape = tuple(int(x) for x in img_shape)
    ndim = {"regions": 2, "grid": 3}[expect]
    if len(shape) != ndim:
        raise ValueError(f"model {model!r} reads {expect} features (row shape of {ndim} dims), "
                         f"got a feature set with row shape {shape}")
    return shape[-1]


def variant_factory(cls, name: str, expect: str, default_shape: tuple, doc: str, **fixed):
    """A registry factory ``(img_shape, vocab_size, <cls's options minus the fixed ones>)``.

    Its signature lists every option explicitly (the trainer passes a factory only the arguments it
    names), and a fixed option of the variant (SMAN-SIM's alpha, SAF's mode) cannot be overridden.
    """
    def factory(img_shape=default_shape, vocab_size: int = 10000, **kwargs):
        clash = sorted(set(kwargs) & set(fixed))
        if clash:
            raise ValueError(f"model {name!r} fixes {', '.join(clash)}; choose another model instead")
        unknown = sorted(set(kwargs) - set(options))
        if unknown:
            raise ValueError(f"model {name!r} takes no argument {', '.join(unknown)}; valid: {', '.join(options)}")
        return cls(vocab_size, img_dim_of(img_shape, expect, name), **kwargs, **fixed)

    options = [p for p in inspect.signature(cls).parameters.values()
               if p.name not in ("self", "vocab_size", "img_dim") and p.name not in fixed]
    head = [inspect.Parameter("img_shape", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default_shape),
            inspect.Parameter("vocab_size", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=10000)]
    factory.__signature__ = inspect.Signature(head + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in options])
    options = [p.name for p in options]
    factory.__name__ = factory.__qualname__ = name.replace("-", "_")
    factory.__doc__ = doc
    return register_model(name)(factory)


sgr = variant_factory(SGRAF, "sgr", "regions", (36, 2048),
                      "SGR: similarity graph reasoning (3 steps) over the global and local similarity nodes.",
                      mode="sgr")
saf = variant_factory(SGRAF, "saf", "regions", (36, 2048),
                      "SAF: similarity attention filtration over the global and local similarity nodes.",
                      mode="saf")
