"""Batch statistics across data-parallel ranks: the hook the models' batch norms consult.

A model's batch statistics (``MaskedBatchNorm1d``'s mean and variance, SAF's per-caption running
estimates) must span the whole global batch when it is split over ranks, or data-parallel training
would learn another model than one process. The trainer installs a :class:`BatchSync` for the
duration of a training step (``with synced(sync): ...``); outside one (evaluation, one process, any
use of the models on their own) :func:`current` is None and the models compute their statistics
from the rows they see, as always. Nothing here imports ``torch.distributed``: the reducer the
trainer installs does (``vsekit.train.distributed``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol

import torch


class BatchSync(Protocol):
    """What a model needs from the ranks of a step."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks, differentiable (the gradient flows to every rank's part)."""

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``tensor`` (dim 0), concatenated in rank order; no gradient."""


_current: BatchSync | None = None


def current() -> BatchSync | None:
    """The reducer of the running step, or None (one process, evaluation, no trainer)."""
    return _current


@contextlib.contextmanager
def synced(sync: BatchSync | None) -> Iterator[None]:
    """Batch statistics are reduced through ``sync`` while the block runs (None: nothing changes)."""
    global _current
    previous, _current = _current, sync
    try:
        yield
    finally:
        _current = previous
