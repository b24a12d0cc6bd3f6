"""Training curves to TensorBoard (``vsekit train --tensorboard DIR``), beside ``metrics.jsonl``.

Each history entry (epoch 0 = the untrained model) becomes scalars at step = epoch: ``train/loss``,
``train/lr`` and every validation metric as ``val/<name>`` (``val/rsum``, ``val/i2t_r1``...). The
writer is opened with ``purge_step`` at the first epoch it logs, so a resumed run's curves replace,
rather than double, what an earlier attempt wrote for the same epochs. TensorBoard is an optional
dependency (``pip install vsekit[tensorboard]``); events go through ``torch.utils.tensorboard``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable


class CurveWriter:
    """Writes history entries as TensorBoard scalars; without a log folder it writes nothing."""

    def __init__(self, logdir: str | Path | None, history: Iterable[dict[str, Any]]):
        self.writer = None
        if logdir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError(f"--tensorboard needs the tensorboard package ({exc}); install it with "
                             f"`pip install tensorboard` (or vsekit[tensorboard])") from None
        history = list(history)
        first = int(history[0]["epoch"]) if history else 0
        self.writer = SummaryWriter(str(logdir), purge_step=first)
        for entry in history:
            self.log(entry)

    def log(self, entry: dict[str, Any]) -> None:
        if self.writer is None:
            return
        step = int(entry["epoch"])
        for key in ("loss", "lr"):
            if entry.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", float(entry[key]), step)
        for key, value in (entry.get("val") or {}).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(f"val/{key}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
