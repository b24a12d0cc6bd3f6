"""Throughput settings of extraction on a GPU: decoding processes sized to the GPUs (``--workers
auto``), pinned host memory with non-blocking copies (``--pin-memory``), channels-last layout
(``--channels-last``). None changes what is computed beyond float rounding, so none is part of a
feature set's settings hash; each can be switched off. docs/gpus_clusters.md, "Throughput on a GPU".
"""

from __future__ import annotations

import contextlib
import os

DECODERS_PER_GPU = 6
PIN_CHOICES = ("auto", "on", "off")


def decode_workers(spec: int | str | None, device: str, n_gpus: int = 1, cpus: int | None = None) -> int:
    """``--workers`` as a number of decoding processes (``auto``: sized to the device, see module doc)."""
    if spec is None or str(spec).strip().lower() == "auto":
        cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        if str(device).startswith("cuda"):
            return max(1, min(DECODERS_PER_GPU * max(1, n_gpus), cpus - 1))
        return max(0, min(2, cpus - 1))
    try:
        n = int(spec)
    except (TypeError, ValueError):
        raise ValueError(f"--workers {spec!r}: expected a number of decoding processes (0: in-process) "
                         f"or auto") from None
    if n < 0:
        raise ValueError(f"--workers {n}: expected >= 0 (0 decodes in-process)")
    return n


def pin_memory(spec: str | bool | None, device: str) -> bool:
    """Whether batches go through pinned memory: ``auto`` → on CUDA only."""
    if isinstance(spec, bool):
        return spec
    s = "auto" if spec is None else str(spec).strip().lower()
    if s not in PIN_CHOICES:
        raise ValueError(f"--pin-memory {spec!r}; valid choices: {', '.join(PIN_CHOICES)}")
    if s == "auto":
        return str(device).startswith("cuda")
    return s == "on"


def to_device(x, device, pinned: bool):
    """Copy a host tensor to ``device``: through page-locked memory and asynchronously when ``pinned``
    (a tensor on a GPU already, as ``--decoder nvjpeg`` gives, is moved as it is)."""
    if x.device.type != "cpu":
        return x.to(device)
    if pinned and str(device).startswith("cuda") and not x.is_pinned():
        x = x.pin_memory()
    return x.to(device, non_blocking=pinned)


def autocast(device, precision: str):
    """``torch.autocast`` on ``device`` in ``bf16`` / ``fp16``; nothing for ``fp32``."""
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision])
