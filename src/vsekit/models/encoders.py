"""Image and text encoders of the embedding models.

- Image: a linear map without bias to the joint space, L2-normalised, ``|.|`` for order embeddings
  (Vendrov et al., "Order-Embeddings of Images and Language", ICLR 2016; Faghri et al., VSE++).
- Text: word embedding + GRU, the hidden state at the caption's true length (Kiros et al. UVS,
  VSE++, Order), and SEAM-E / SEAM-C / SEAM-G (Wehrmann et al., "Self-Attentive Sentence Embeddings
  for Image-Text Matching" / SEAM), whose attention is the structured self-attention of Lin et al.
  (ICLR 2017, eq. 5-6): ``A = softmax(W2 tanh(W1 H^T))`` over words, ``M = A H``, with the penalty
  ``||A A^T - I||_F^2`` (eq. 8). The public SEAM code computes the penalty but never adds it to the
  loss; here it is added (``extra_loss``), as the paper says.

Padding never changes an output: padded words are masked out of the GRU (packed sequences), out of
the attention softmax, and are zero inputs to the SEAM-C convolutions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-8) -> torch.Tensor:
    """x / ||x||, as the VSE/SCAN/SGRAF references' x / (||x|| + eps) but with the norm clamped at eps,
    so a zero vector (padding) stays zero *and* has a finite gradient (sqrt's is infinite at 0)."""
    return x / x.pow(2).sum(dim, keepdim=True).clamp_min(eps * eps).sqrt()


def softmax_short_rows(x: torch.Tensor) -> torch.Tensor:
    """In-place softmax over a short last dimension (a graph's ~10-50 nodes, T-EMDE's 8 centroids). torch's softmax
    kernel is 3-4x slower than these three passes on rows that short; masked entries are expected
    as large negative logits already added to ``x``."""
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool, True at real words."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


class ImageEncoder(nn.Module):
    """x → l2norm(W x), W without bias; ``|.|`` of the result when ``use_abs``."""

    def __init__(self, img_dim: int, embed_dim: int, use_abs: bool = False):
        super().__init__()
        self.fc = nn.Linear(img_dim, embed_dim, bias=False)
        self.use_abs = use_abs
        # Xavier init as in the VSE++ / order-embedding code
        r = (6.0 / (img_dim + embed_dim)) ** 0.5
        nn.init.uniform_(self.fc.weight, -r, r)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        x = l2norm(self.fc(feats.to(self.fc.weight.dtype)))   # stored int8/float16 rows in the weights' dtype
        return x.abs() if self.use_abs else x


class _HiddenBias(torch.autograd.Function):
    """A GRU's hidden-to-hidden bias repeated for every row of the packed words, whose backward is
    that bias's and its weight's gradient over every step at once: the weight's is one product of
    (3H x words) by (words x H) instead of one product per step whose inner size is the step's
    batch (128 or fewer: a thin product the CPU runs at a fraction of its sgemm rate, issue 47).
    ``states``: a list that the forward loop fills with each step's incoming hidden state."""

    @staticmethod
    def forward(ctx, weight, bias, rows: int, states: list):
        ctx.states, ctx.has_bias = states, bias is not None
        return (bias if bias is not None else weight.new_zeros(len(weight))).expand(rows, -1).clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        h = torch.cat(ctx.states)
        return grad.t().mm(h.to(grad.dtype)), (grad.sum(0) if ctx.has_bias else None), None, None


def gru_last(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The hidden state of a one-layer ``gru`` after each sequence's last real step (``x``: (B, T, in),
    batch first; a length of 0 counts as 1): what ``gru`` returns for the packed sequences, the same
    arithmetic value for value, stepped here over the sequences still running.

    Why not ``gru`` itself: torch's CPU GRU over packed sequences projects every word's input at once
    and then slices that projection per step, and the backward of each slice writes a zero gradient
    the size of the whole projection (T fills and adds of words x 3H: a fifth of VSE++'s step at
    batch 128, issue 47). Here the projection is split once, whose backward concatenates once, and
    the hidden-to-hidden weight's gradient is one product over all steps (:class:`_HiddenBias`; in
    float32 only: under bf16 autocast the profiler counted 25 % more matmul FLOPs with it than torch's
    GRU, gpu_check's CPU mode, not yet understood, so bf16 keeps the per-step products).
    """
    packed = pack_padded_sequence(x, lengths.cpu().clamp(min=1), batch_first=True, enforce_sorted=False)
    if x.device.type != "cpu":      # cuDNN's fused GRU has no such slices
        return gru(packed)[1][-1]
    sizes = packed.batch_sizes.tolist()
    # under autocast the products are bf16 and the state float32, as in torch's cell
    gates = F.linear(packed.data, gru.weight_ih_l0, gru.bias_ih_l0).split(sizes)
    states: list[torch.Tensor] = []
    if torch.is_autocast_enabled(x.device.type):    # bf16: torch's products per step, as before (see below)
        w, hidden = gru.weight_hh_l0, [gru.bias_hh_l0] * len(sizes)
    else:   # the weight's gradient comes from _HiddenBias, once
        w = gru.weight_hh_l0.detach()
        hidden = _HiddenBias.apply(gru.weight_hh_l0, gru.bias_hh_l0, len(packed.data), states).split(sizes)
    h, done = packed.data.new_zeros(sizes[0], gru.hidden_size), []
    for gi, bh, n in zip(gates, hidden, sizes):
        if n < len(h):          # the shortest sequences ended: their states are final
            done.append(h[n:])
            h = h[:n]
        states.append(h.detach())
        ir, iz, i_n = gi.chunk(3, 1)
        hr, hz, hn = F.linear(h, w, bh).chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n_ = torch.tanh(i_n + r * hn)
        h = (h - n_) * z + n_   # torch's cell: (1 - z) * n + z * h, in its order of operations
    return torch.cat([h, *done[::-1]])[packed.unsorted_indices]


class GRUTextEncoder(nn.Module):
    """Word embedding + GRU; the output is the hidden state after the caption's last real word."""

    def __init__(self, vocab_size: int, word_dim: int, embed_dim: int, use_abs: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        self.gru = nn.GRU(word_dim, embed_dim, batch_first=True)
        self.use_abs = use_abs

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = l2norm(gru_last(self.gru, self.embed(tokens), lengths))
        return out.abs() if self.use_abs else out


class SelfAttention(nn.Module):
    """Lin et al. structured self-attention: h hops over the words of H (B, L, d), padding masked.

    Returns the flattened ``A H`` (B, hops*d) and the per-caption penalty ``||A A^T - I||_F^2`` (B,).
    """

    def __init__(self, in_dim: int, units: int, hops: int):
        super().__init__()
        self.w1 = nn.Linear(in_dim, units, bias=False)
        self.w2 = nn.Linear(units, hops, bias=False)
        self.hops = hops

    def attention(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A as (B, hops, L); rows sum to 1 over real words, zero at padding."""
        logits = self.w2(torch.tanh(self.w1(h))).transpose(1, 2)
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.softmax(logits, dim=-1)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.attention(h, mask)
        m = torch.bmm(a, h).flatten(1)
        eye = torch.eye(self.hops, device=h.device, dtype=a.dtype)
        penalty = ((torch.bmm(a, a.transpose(1, 2)) - eye) ** 2).sum(dim=(1, 2))
        return m, penalty


class SeamTextEncoder(nn.Module):
    """SEAM-E / SEAM-C / SEAM-G caption encoder; returns (embedding (B, D), penalty (B,)).

    - ``e``: attention straight over the word embeddings.
    - ``c``: two Conv1d over the embeddings (kernel 2 and 3, ``filters`` each, zero-padded to keep
      the length, ReLU); three attention modules over conv-2, conv-3 and the embeddings, concatenated.
    - ``g``: a GRU (``gru_dim`` units) over the embeddings, then attention over its outputs.
    The flattened attention output goes through a linear map to the joint space and is L2-normalised.
    """

    def __init__(self, variant: str, vocab_size: int, word_dim: int, embed_dim: int, *, hops: int,
                 att_units: int = 300, filters: int = 100, gru_dim: int = 512, use_abs: bool = False):
        super().__init__()
        if variant not in ("e", "c", "g"):
            raise ValueError(f"unknown SEAM variant {variant!r}; valid choices: e, c, g")
        self.variant, self.use_abs = variant, use_abs
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        if variant == "e":
            self.att = nn.ModuleList([SelfAttention(word_dim, att_units, hops)])
            flat = hops * word_dim
        elif variant == "c":
            self.conv2 = nn.Conv1d(word_dim, filters, kernel_size=2)
            self.conv3 = nn.Conv1d(word_dim, filters, kernel_size=3)
            self.att = nn.ModuleList([SelfAttention(filters, att_units, hops),
                                      SelfAttention(filters, att_units, hops),
                                      SelfAttention(word_dim, att_units, hops)])
            flat = hops * (2 * filters + word_dim)
        else:
            self.gru = nn.GRU(word_dim, gru_dim, batch_first=True)
            self.att = nn.ModuleList([SelfAttention(gru_dim, att_units, hops)])
            flat = hops * gru_dim
        self.fc = nn.Linear(flat, embed_dim)
        # as the SEAM reference code: Xavier-uniform weights of every linear map and convolution
        # (biases keep torch's default); the word embeddings stay U(-0.1, 0.1)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d)):
                nn.init.xavier_uniform_(m.weight)

    def _conv(self, conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        # zero padding after the words keeps the length: output t sees words t..t+k-1
        k = conv.kernel_size[0]
        y = conv(F.pad(x.transpose(1, 2), (0, k - 1)))
        return F.relu(y).transpose(1, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # host lengths (the trainer's) stay on the host for packing; the mask is formed on the device
        mask = length_mask(lengths.to(tokens.device, non_blocking=True), tokens.shape[1])
        x = self.embed(tokens) * mask[..., None]
        if self.variant == "e":
            states = [x]
        elif self.variant == "c":
            states = [self._conv(self.conv2, x), self._conv(self.conv3, x), x]
        else:
            packed = pack_padded_sequence(x, lengths.cpu().clamp(min=1), batch_first=True, enforce_sorted=False)
            out, _ = self.gru(packed)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
            states = [out]
        flats, penalty = [], 0
        for att, h in zip(self.att, states):
            m, p = att(h, mask)
            flats.append(m)
            penalty = penalty + p
        emb = l2norm(self.fc(torch.cat(flats, dim=1)))
        return (emb.abs() if self.use_abs else emb), penalty
