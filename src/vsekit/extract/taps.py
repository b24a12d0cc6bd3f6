"""Named layer taps: forward hooks that reduce a layer's output as soon as it is produced.

For the Full-Network Embedding (Vilalta et al., Sec. 3) every tap of a conv map is its spatial
average, computed *inside* the hook, so the full activation is never kept; 2-D outputs (fc layers)
are kept as they are. A module called more than once in a forward pass (e.g. torchvision's shared
``Bottleneck.relu``) is tapped at its last call. Once the last hook of a pass has fired, the rest of
the network is skipped.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Sequence

Reduce = Callable[[Any], Any]


class _StopForward(Exception):
    """Raised by the last hook of a pass so that layers after the last tap are not computed."""


def spatial_mean(out):
    """(B, C, H, W) → (B, C) average over positions; (B, C) unchanged; other ranks flattened."""
    if out.ndim == 4:
        return out.float().mean(dim=(2, 3))
    if out.ndim == 3:  # token sequences (B, L, C): average over tokens
        return out.float().mean(dim=1)
    return out.float().reshape(out.shape[0], -1)


def keep_map(out):
    return out


@dataclass(frozen=True)
class TapInfo:
    name: str
    module_type: str
    shape: tuple[int, ...]  # output shape without the batch dimension
    calls: int

    @property
    def width(self) -> int:
        return int(self.shape[0]) if len(self.shape) in (1, 3) else int(self.shape[-1])


class Tapper:
    """Hooks on ``names`` that store ``reduce(output)`` per name; usable as a context manager."""

    def __init__(self, model, names: Sequence[str], reduce: Reduce = spatial_mean,
                 total_calls: int | None = None):
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"no layer {missing[0]!r} in this model; list them with --list-layers")
        self.names = list(names)
        self.reduce = reduce
        self.values: dict[str, Any] = {}
        self.total_calls = total_calls
        self.calls = 0
        self._handles = [modules[n].register_forward_hook(self._hook(n)) for n in self.names]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            self.values[name] = self.reduce(output)
            self.calls += 1
            if self.total_calls is not None and self.calls >= self.total_calls:
                raise _StopForward
        return hook

    def run(self, model, x) -> list[Any]:
        """One forward pass; returns the reduced outputs in tap order."""
        self.values.clear()
        self.calls = 0
        try:
            model(x)
        except _StopForward:
            pass
        return [self.values[n] for n in self.names]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "Tapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def probe(model, input_size: int, names: Sequence[str] | None = None) -> dict[str, TapInfo]:
    """Output shapes and call counts of layers (all named modules by default) from a meta forward.

    ``model`` should live on the meta device, so this costs no memory and no compute.
    """
    import torch

    modules = dict(model.named_modules())
    names = [n for n in modules if n] if names is None else list(names)
    shapes: dict[str, tuple[int, ...]] = {}
    calls: dict[str, int] = {}
    order: list[str] = []

    def make(name):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor):
                if name not in shapes:
                    order.append(name)
                shapes[name] = tuple(int(s) for s in output.shape[1:])
                calls[name] = calls.get(name, 0) + 1
        return hook

    handles = [modules[n].register_forward_hook(make(n)) for n in names if n in modules]
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, input_size, input_size, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return {n: TapInfo(n, type(modules[n]).__name__, shapes[n], calls[n]) for n in order}


def select_taps(model, pattern: str, input_size: int) -> list[str]:
    """Layers whose names match any comma-separated glob in ``pattern``, in execution order."""
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    info = probe(model, input_size)
    chosen = [n for n in info if any(fnmatch.fnmatchcase(n, p) for p in pats)]
    # drop layers whose output is not a conv map / vector (e.g. flattened token grids are fine)
    chosen = [n for n in chosen if len(info[n].shape) in (1, 2, 3)]
    if not chosen:
        raise ValueError(f"--taps {pattern!r} matches no layer of this model; list them with --list-layers")
    return chosen


def list_layers(model_name: str, input_size: int | None = None) -> list[dict[str, Any]]:
    """Every named layer of ``model_name`` with its output shape and FNE width (meta device)."""
    from .backbones import build_model, get_backbone

    spec = get_backbone(model_name)
    model = build_model(model_name, "none", device="meta")
    size = input_size or spec.preprocess(model).crop_size
    info = probe(model, size)
    default = set(spec.fne_taps(model))
    return [{"name": n, "type": i.module_type, "shape": list(i.shape), "width": i.width,
             "default_tap": n in default, "calls": i.calls} for n, i in info.items()]
