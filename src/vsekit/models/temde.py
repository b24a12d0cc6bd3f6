"""T-EMDE: the sketch coder that replaces SGRAF's global self-attention, and a masked batch norm.

Paper: "Sketching the modalities: T-EMDE" (Synerise; EMDE = Efficient Manifold Density Estimator,
Dabrowski et al.), used as the global-similarity module of SAF / SGR (Diao et al., SGRAF, AAAI 2021).

For every member x of a set (the regions of an image or the words of a caption) the coder computes

    z = BN(W x)                     reshaped to (N, K, D)        N divisions, K centroids, D dims
    dist[n, k] = sum_d (z[n, k, d] - c[n, k, d])^2               c: N*K learned centroids
    p[n, :] = softmax_k(-dist[n, :] * tau)                         tau: learned temperature (> 0)

and the set's sketch is ``S[n] = l2norm(sum_members p[n])`` flattened to N*K (= 160). Padding never
contributes: its assignments are zeroed before the sum, and its vectors are left out of the batch
statistics. The image and text sketches of a pair are concatenated and mapped by a linear layer and a
ReLU to the global similarity node of SAF / SGR.

Choices where the paper leaves room: the temperature is one scalar stored as its log (so it stays
positive); images and captions have separate coders (their members live in different spaces, and the
sketches only meet in the linear layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .encoders import softmax_short_rows
from .sync import current as current_sync


class MaskedBatchNorm1d(nn.Module):
    """Batch norm over the last (channel) dimension whose statistics skip padded positions.

    ``x`` is (..., C) and ``mask`` (...) is True for real members. In training the mean and the
    (biased) variance come from the masked members only and update the running estimates; in
    evaluation the running estimates are used, so a member's output never depends on the others.
    Padded outputs are set to zero. The torch reference ``BatchNorm1d(num_regions)`` of SGRAF
    normalises per region *slot* and so only works with exactly 36 regions; this normalises per
    channel over the real regions, which is what the equations describe.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            # statistics in float32 at least (under autocast x may be bf16), weighted by the mask
            # rather than gathered with it (boolean indexing would synchronise a GPU every call)
            flat = x.reshape(-1, self.num_features)
            if flat.dtype in (torch.float16, torch.bfloat16):
                flat = flat.float()
            n, mean, var = self._statistics(flat, mask, current_sync())
            members = n > 0          # none: the running estimates, unchanged
            mean = torch.where(members, mean, self.running_mean.to(mean.dtype))
            var = torch.where(members, var, self.running_var.to(var.dtype))
            with torch.no_grad():
                unbiased = torch.where(n > 1, var * (n / (n - 1).clamp(min=1)), var)
                dtype = self.running_mean.dtype
                self.running_mean.lerp_(mean.detach().to(dtype), self.momentum)
                self.running_var.lerp_(unbiased.detach().to(dtype), self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        y = (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias
        if mask is not None:
            y = y * mask.unsqueeze(-1).to(y.dtype)
        return y

    @staticmethod
    def _statistics(flat: torch.Tensor, mask: torch.Tensor | None, sync):
        """Members, mean and biased variance of the real rows, in two passes about the mean.
        Data-parallel (``sync``, :mod:`.sync`) over every rank's rows: the sums are reduced with
        autograd, so every rank normalises with the global batch's statistics, as one process."""
        reduce = (lambda t: t) if sync is None else sync.all_reduce
        w = None if mask is None else mask.reshape(-1, 1).to(flat.dtype)
        n_local = flat.new_full((1,), float(flat.shape[0])) if w is None else w.sum().reshape(1)
        s1 = flat.sum(0) if w is None else (flat * w).sum(0)
        both = reduce(torch.cat([s1, n_local]))
        s1, n = both[:-1], both[-1].detach()
        mean = s1 / n.clamp(min=1)
        dev = (flat - mean).pow(2)
        s2 = reduce(dev.sum(0) if w is None else (dev * w).sum(0))
        return n, mean, s2 / n.clamp(min=1)


class TEMDECoder(nn.Module):
    """Soft-assigns each member of a set to N x K centroids and sums them into a sketch."""

    def __init__(self, in_dim: int, divisions: int = 20, centroids: int = 8, dim: int = 8):
        super().__init__()
        self.divisions, self.centroids, self.dim = divisions, centroids, dim
        self.proj = nn.Linear(in_dim, divisions * centroids * dim)
        self.bn = MaskedBatchNorm1d(divisions * centroids * dim)
        self.centers = nn.Parameter(torch.randn(divisions, centroids, dim))
        self.log_temperature = nn.Parameter(torch.zeros(()))

    @property
    def sketch_dim(self) -> int:
        return self.divisions * self.centroids

    def assignments(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, L, in_dim) members -> (B, L, N, K) soft assignments; padded members are zero.

        In evaluation the batch norm is a fixed affine map, so it and the centroids fold into the
        projection (``z - c = W' x + b'``): one linear layer and a square, with no normalised
        copy of the (members x N*K*D) projections. Training keeps the literal form, whose batch
        statistics depend on the batch.
        """
        if self.training:
            z = self.bn(self.proj(x), mask)
            z = z.view(*x.shape[:-1], self.divisions, self.centroids, self.dim) - self.centers
        else:
            weight, bias = self._folded()
            z = F.linear(x, weight, bias).view(*x.shape[:-1], self.divisions, self.centroids, self.dim)
        dist = z.pow(2).sum(-1)
        p = torch.softmax(-dist * self.log_temperature.exp(), dim=-1)
        return p * mask[..., None, None].to(p.dtype)

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Projection with the evaluation batch norm and the centroids folded in: ``z - c = W' x + b'``."""
        bn = self.bn
        scale = bn.weight * torch.rsqrt(bn.running_var + bn.eps)
        weight = self.proj.weight * scale[:, None]
        bias = (self.proj.bias - bn.running_mean) * scale + bn.bias - self.centers.reshape(-1)
        return weight, bias

    def raw_sketch(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The sum of the members' assignments, before normalisation: (B, N, K).

        In evaluation without autograd only the real members are coded (padding would be zeroed
        anyway) and summed into their item's sketch; the squared distances sum over D as one
        product with a ones vector, and the short softmax over the K centroids runs as three
        in-place passes. The same sketch as the literal form, a third of its time at demo dims.
        """
        if self.training or torch.is_grad_enabled():
            return self.assignments(x, mask).sum(1)
        weight, bias = self._folded()
        owner = mask.nonzero()[:, 0]
        z = F.linear(x[mask], weight, bias).square_()
        dist = (z.view(-1, self.dim) @ z.new_ones(self.dim, 1)).view(-1, self.divisions, self.centroids)
        p = softmax_short_rows(dist.mul_(-self.log_temperature.exp()))
        return x.new_zeros(x.shape[0], self.divisions, self.centroids).index_add_(0, owner, p)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, L, in_dim), (B, L) bool -> (B, N*K) sketch, L2-normalised per division."""
        return F.normalize(self.raw_sketch(x, mask), dim=-1, eps=1e-8).flatten(1)


class TEMDEGlobal(nn.Module):
    """Image and text coders plus the linear + ReLU that turns a pair of sketches into a node."""

    def __init__(self, embed_dim: int, sim_dim: int = 256, divisions: int = 20, centroids: int = 8,
                 dim: int = 8):
        super().__init__()
        self.image_coder = TEMDECoder(embed_dim, divisions, centroids, dim)
        self.text_coder = TEMDECoder(embed_dim, divisions, centroids, dim)
        self.fuse = nn.Linear(2 * divisions * centroids, sim_dim)

    def pair(self, img_sketch: torch.Tensor, cap_sketch: torch.Tensor) -> torch.Tensor:
        """ReLU(W [s_img; s_cap] + b) for every image x caption pair: (n_img, n_cap, sim_dim).

        The linear map of a concatenation is the sum of two maps, so the block is an outer sum.
        """
        n = img_sketch.shape[1]
        w_img, w_cap = self.fuse.weight[:, :n], self.fuse.weight[:, n:]
        a = img_sketch @ w_img.t()
        b = cap_sketch @ w_cap.t() + self.fuse.bias
        return F.relu(a[:, None, :] + b[None, :, :])
