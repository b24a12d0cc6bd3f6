"""One optimisation step over a global batch, the same in one process and over data-parallel ranks.

Only torch and the models are needed here (no store): ``bench/train_ddp.py`` times these steps.
"""

from __future__ import annotations

import weakref

import torch

from ..models.base import RetrievalModel
from ..models.sync import synced
from .config import TrainConfig
from .distributed import SINGLE, Group, RankFailure


# device and precision --------------------------------------------------------------------------------
def to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A batch tensor on ``device``: on CUDA copied from pinned memory without blocking the host
    (the copy overlaps the previous step's device work); elsewhere ``.to`` (a no-op on the CPU)."""
    if t is None:
        return None
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def autocast(cfg: TrainConfig, device: torch.device):
    """The forward pass's precision context: bf16 autocast for ``--precision bf16``, else a no-op."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


# the step ---------------------------------------------------------------------------------------
def _loss_dtype(scores: torch.Tensor) -> torch.Tensor:
    """The loss in float32 at least, whatever the forward's precision (float64 stays float64)."""
    return scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores


def step_loss(net: RetrievalModel, batch, loss_fn, cfg: TrainConfig, device: torch.device,
              group: Group = SINGLE) -> torch.Tensor:
    """The global batch's loss, as one process computes it, with this rank's share of the graph.

    Data-parallel (and a global batch of at least one row per rank), this rank encodes its slice,
    the encodings are gathered with autograd, it scores every image against its captions (so SAF's
    per-caption batch norm sees every image), and the column blocks are gathered into the full score
    matrix (docs/train.md, "What is exact"). The caller back-propagates the loss (:func:`train_step`).
    """
    n = len(batch.images)
    images = to_device(batch.images, device)
    given = getattr(batch, "part", None)     # the stream gave this rank's rows only
    if given is not None and not (group.distributed and n >= group.world):
        given = None                          # a batch smaller than the rank count: all of it, on every rank
    if group.distributed and n >= group.world:
        sizes = group.sizes(n)
        part = slice(None) if given is not None else group.part(n)
        counts = None if batch.counts is None else batch.counts[part]
        with synced(group), autocast(cfg, device):
            img = net.encode_images(to_device(batch.feats[part], device), to_device(counts, device))
            cap = net.encode_captions(to_device(batch.tokens[part], device), batch.lengths[part])
            img_all = group.gather(img, sizes)
            cap_all = group.gather(cap, sizes)
            block = net.score(img_all, cap)
            scores = group.gather_dim(block, sizes, 1)
    else:
        with autocast(cfg, device):
            img_all = net.encode_images(to_device(batch.feats, device), to_device(batch.counts, device))
            # lengths stay on the host: the models pack with them, and form their masks on the device
            cap_all = net.encode_captions(to_device(batch.tokens, device), batch.lengths)
            scores = net.score(img_all, cap_all)
    scores = _loss_dtype(scores)
    loss = loss_fn(scores, images)
    extra = net.extra_loss(img_all, cap_all, scores)
    if extra is not None:
        loss = loss + _loss_dtype(extra)
    return loss


class StepLoss(torch.nn.Module):
    """The step as a module whose forward is :func:`step_loss`: what ``DistributedDataParallel`` wraps."""

    def __init__(self, net: RetrievalModel):
        super().__init__()
        self.net = net

    def forward(self, batch, loss_fn, cfg: TrainConfig, device: torch.device, group: Group) -> torch.Tensor:
        return step_loss(self.net, batch, loss_fn, cfg, device, group)


#: DDP's gradient bucket size in MB (None: torch's default, 25 MB after a first bucket of 1 MB)
BUCKET_MB: float | None = None
_WRAPPED: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()


def reduce_touched_rows(state: tuple[Group, frozenset[int]], bucket):   # no annotations: DDP checks them as objects
    """DDP's communication hook: a bucket of gradients averaged over the ranks, a word embedding's
    only in the rows some rank's gradient is not zero in (a batch touches a few hundred words).

    The rows no rank touched are zero on every rank, so their average is zero and is not sent: the
    result is the dense average's, value for value (each gradient divided by the rank count, then
    summed, as DDP does without a hook). ``state``: the group, and the ``id`` of each embedding's
    weight. Returns the future of the averaged bucket.
    """
    import torch.distributed as dist

    group, tables = state
    buf = bucket.buffer()

    def at(g: torch.Tensor) -> int:   # a gradient's offset in the bucket
        return (g.data_ptr() - buf.data_ptr()) // buf.element_size()

    picked = sorted((g for p, g in zip(bucket.parameters(), bucket.gradients()) if id(p) in tables), key=at)
    pieces, start = [], 0
    for g in picked:
        pieces.append(buf[start:at(g)])
        start = at(g) + g.numel()
    pieces.append(buf[start:])
    if picked:
        # the union over the ranks of the rows with a non-zero gradient (a byte per row)
        picked = [g.view(len(g), -1) for g in picked]
        # each row's largest |g|: one pass; a NaN row counts as touched, as with ne(0)
        touched = torch.cat([t.abs().amax(1).ne(0) for t in picked]).to(torch.uint8)
        dist.all_reduce(touched, op=dist.ReduceOp.MAX)
        group.traffic["reduce"] += touched.numel()
        rows = [i.nonzero().squeeze(1) for i in touched.bool().split([len(t) for t in picked])]
        picked = [(t, i, t.index_select(0, i)) for t, i in zip(picked, rows)]
        pieces += [sel.view(-1) for _, _, sel in picked]
    pieces = [x.div_(group.world) for x in pieces if x.numel()]
    group.traffic["reduce"] += sum(x.numel() for x in pieces) * buf.element_size()
    works = [dist.all_reduce(x, async_op=True).get_future() for x in pieces]

    def scatter(_):
        for t, i, sel in picked:
            t.index_copy_(0, i, sel)
        return buf
    return torch.futures.collect_all(works).then(scatter)


def data_parallel(net: RetrievalModel, group: Group) -> torch.nn.Module:
    """``net``'s step wrapped in ``DistributedDataParallel`` (built once per model, on every rank at
    the same step: DDP's construction is a collective), or the plain step in one process."""
    if not group.distributed:
        return StepLoss(net)
    if net not in _WRAPPED:
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters only for a model that declares parameters without a gradient (SMAN's
        # and SGR's biases before a softmax): the search is a graph traversal per step, which the
        # other families do not pay; the buckets are all-reduced from the first step in one order
        # (static_graph would hold all gradients in one bucket for two steps).
        # forward_sync_buffers off: batch-norm statistics are already the global batch's
        # (models/sync.py) and every rank holds the same buffers. gradient_as_bucket_view: the
        # gradients are views of the all-reduced buckets (no copy back, no second copy in memory).
        _WRAPPED[net] = group.check("the data-parallel wrapper's start", DistributedDataParallel, StepLoss(net),
                                    find_unused_parameters=bool(getattr(net, "unused_parameters", False)),
                                    forward_sync_buffers=False, gradient_as_bucket_view=True,
                                    bucket_cap_mb=BUCKET_MB)
        tables = frozenset(id(m.weight) for m in net.modules() if isinstance(m, torch.nn.Embedding))
        _WRAPPED[net].register_comm_hook((group, tables), reduce_touched_rows)
    return _WRAPPED[net]


def train_step(net: RetrievalModel, batch, loss_fn, optim: torch.optim.Optimizer, cfg: TrainConfig,
               device: torch.device, group: Group = SINGLE, flags: tuple[float, ...] = ()
               ) -> tuple[torch.Tensor, list[float]]:
    """One optimisation step on a global batch; returns its loss and ``flags`` (a stop request, a
    checkpoint due) summed over the ranks while backward runs. DDP averages the gradients over the
    ranks, which gives every rank one process's gradient: every rank clips and steps as one process."""
    step = data_parallel(net, group)
    summed = group.sum_async(flags)
    try:
        loss = step(batch, loss_fn, cfg, device, group)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        flags = summed()
    except RankFailure:   # already worded by the collective that failed
        raise
    except RuntimeError as exc:
        if group.distributed and _collective_error(exc):
            raise RankFailure(group.failure_message("a training step", exc)) from None
        raise
    if cfg.grad_clip and cfg.grad_clip > 0:
        clip_grad_norm(net.parameters(), cfg.grad_clip, device)
    optim.step()
    return loss, flags


def clip_grad_norm(params, max_norm: float, device: torch.device) -> None:
    """``torch.nn.utils.clip_grad_norm_``, value for value; on the CPU the gradients are scaled only
    when the factor min(1, max_norm / norm) is not 1. torch always multiplies, so as not to wait for a
    GPU; on the CPU that is a pass over every gradient for nothing (VSE++: 37 MB read and written)."""
    if not hasattr(torch.nn.utils, "get_total_norm"):   # torch < 2.6 (pyproject allows 2.4): torch's clip
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if device.type != "cpu" or not bool(max_norm / (norm + 1e-6) >= 1):   # NaN: scaled, as torch does
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def _collective_error(exc: BaseException) -> bool:
    """Whether a collective's error is a peer's failure (dead, hung, unreachable) rather than a bug
    (a tensor on a device the group has no backend for is a bug, and is raised as it is)."""
    text = str(exc).lower()
    if "no backend type associated" in text:
        return False
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))


def step_seed(seed: int, epoch: int, step: int, rank: int) -> int:
    """The torch seed of a data-parallel step (dropout masks are drawn per rank: docs/train.md)."""
    import hashlib

    digest = hashlib.sha256(f"vsekit-step/{seed}/{epoch}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


