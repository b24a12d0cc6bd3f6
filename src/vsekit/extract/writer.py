"""The block buffer (one row block being assembled) and the writer: a background thread that commits
finished blocks, so the model never waits on Zarr.

The reasons of a block's failed rows go first (the driver process is the only writer of attrs), then
its data and auxiliary arrays, then its status (FeatureSet.write_block).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..storage.store import DONE, FAILED, Block, FeatureSet
from .plan import Plan
from .regions import region_arrays


@dataclass
class BlockBuffer:
    """One row block being assembled: features, status, region boxes and counts, errors."""

    block: Block
    data: np.ndarray
    status: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    filled: int = 0
    decoders: set = field(default_factory=set)   # the process:thread names that decoded its rows

    @classmethod
    def empty(cls, plan: Plan, block: Block) -> "BlockBuffer":
        n = len(block)
        extra = {k: np.zeros((n, *shape), dtype) for k, (shape, dtype) in region_arrays(plan).items()
                 } if plan.kind == "regions" else {}
        return cls(block, np.zeros((n, *plan.row_shape), dtype=plan.store_dtype), np.zeros(n, np.uint8), extra)

    def put(self, row: int, features: np.ndarray | None, error: str | None = None,
            boxes: np.ndarray | None = None) -> None:
        i = row - self.block.start
        if error is not None:
            self.status[i] = FAILED
            self.errors[row] = error
        else:
            if self.data.dtype == np.float16:  # saturate: a random-weight net can exceed fp16's range
                features = np.clip(features, -65504.0, 65504.0)
            self.data[i] = features
            self.status[i] = DONE
            if boxes is not None:
                self.extra["boxes"][i, :len(boxes)] = boxes
                self.extra["count"][i] = len(boxes)
        self.filled += 1

    @property
    def full(self) -> bool:
        return self.filled == len(self.block)

    def write(self, fs: FeatureSet, record_errors: bool = True) -> bool:
        """The failure reasons go first: a kill between them and the block leaves the block pending
        (its reasons are rewritten on the rerun), never failed rows without a reason. False when
        another writer committed the block first (object storage: nothing of this one was written)."""
        if record_errors:
            fs.record_errors(self.errors)
        return fs.write_block(self.block, self.data, self.status, **self.extra)


class BlockWriter:
    """Commits submitted blocks (``commit(buf)``) in a background thread; at most ``depth`` blocks
    wait in memory. An error is raised to the caller on the next submit or on close."""

    def __init__(self, commit: Callable[[BlockBuffer], Any], depth: int = 2):
        self.commit = commit
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, name="vsekit-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for buf in iter(self._queue.get, None):
            if self.error is None:   # after an error the rest is dropped
                try:
                    self.commit(buf)
                except BaseException as exc:  # reported to the caller on the next submit/close
                    self.error = exc

    def submit(self, buf: BlockBuffer) -> None:
        if self.error is not None:
            raise self.error
        self._queue.put(buf)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error
