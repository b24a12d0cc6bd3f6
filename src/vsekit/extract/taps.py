"""Named layer taps: forward hooks that reduce a layer's output as soon as it is produced (the
Full-Network Embedding's spatial averages, Vilalta et al., Sec. 3), each into a *new* tensor that no
later in-place layer can overwrite, the forward pass stopped after the last tap; and each tap's
layout (NCHW, NHWC, tokens, vectors), decided on the meta device and refused, never guessed, when it
cannot be told. docs/extract.md, "Kinds" and "Layouts".
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

Reduce = Callable[[Any], Any]
LAYOUTS = ("NCHW", "NHWC", "NLC", "NC")


class _StopForward(Exception):
    """Raised by the last hook of a pass so that layers after the last tap are not computed."""


@dataclass(frozen=True)
class Layout:
    """How a tap's output is laid out: ``kind`` in LAYOUTS, ``prefix`` non-spatial leading tokens."""

    kind: str
    prefix: int = 0

    def width(self, shape: Sequence[int]) -> int:
        """Channels of an output of ``shape`` (batch dimension excluded)."""
        return int(shape[-1] if self.kind in ("NHWC", "NLC") else shape[0])

    def side(self, shape: Sequence[int]) -> int:
        """Spatial side of a square map (0 for vectors, or token counts that are not a square)."""
        if self.kind == "NCHW":
            return int(shape[1])
        if self.kind == "NHWC":
            return int(shape[0])
        if self.kind == "NLC":
            n = int(shape[0]) - self.prefix
            return math.isqrt(n) if n > 0 and math.isqrt(n) ** 2 == n else 0
        return 0


def to_nchw(out, layout: Layout):
    """A (B, C, H, W) view of a spatial output; tokens lose their prefix and become a square grid."""
    if layout.kind == "NCHW":
        return out
    if layout.kind == "NHWC":
        return out.permute(0, 3, 1, 2)
    if layout.kind == "NLC":
        t = out[:, layout.prefix:]
        side = math.isqrt(t.shape[1])
        if side * side != t.shape[1]:
            raise ValueError(f"{t.shape[1]} tokens do not form a square grid")
        return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], side, side)
    raise ValueError(f"a {layout.kind} output has no spatial positions")


#: at most this many bytes of a tapped map are converted to float32 at once (a batch chunk)
POOL_CHUNK_BYTES = 64 << 20


def _by_chunks(x, fn):
    """``fn(x.float())`` computed on batch chunks converted into one reused float32 buffer (of
    ``x.float()``'s strides, so ``fn`` reduces in the same order), never all of ``x`` at once."""
    import torch

    n = x.shape[0]
    step = max(1, POOL_CHUNK_BYTES // (max(1, x[0].numel() * 4) if n else 1))
    if step >= n:
        return fn(x.float())
    buf = torch.empty_like(x[:step], dtype=torch.float32)   # one buffer: no allocation per chunk
    first = fn(buf.copy_(x[:step]))
    out = torch.empty((n, *first.shape[1:]), dtype=first.dtype, device=first.device)
    out[:step] = first
    for i in range(step, n, step):
        k = min(step, n - i)
        out[i:i + k] = fn(buf[:k].copy_(x[i:i + k]))
    return out


def mean_f32(x, dims):
    """``x.float().mean(dim=dims)`` without a float32 copy of the whole of ``x``.

    float32 input: exactly that (no copy is made). On CUDA, a bf16/fp16 input is reduced by
    ``mean(dtype=float32)``, which accumulates in float32 straight from the half-precision values
    (torch makes no float32 copy of a CUDA half input for this reduction). Elsewhere (the CPU would
    make that copy internally) the batch is converted and reduced a chunk of rows at a time through
    one buffer of at most ``POOL_CHUNK_BYTES``; each row's mean is the same computation as on the
    whole batch, so the values equal ``x.float().mean(dim=dims)``
    (``tests/test_taps_memory.py``).
    """
    import torch

    if x.dtype == torch.float32:
        return x.mean(dim=dims)
    if x.device.type == "cuda":
        return x.mean(dim=dims, dtype=torch.float32)
    return _by_chunks(x, lambda c: c.mean(dim=dims))


def spatial_mean(out, layout: Layout = Layout("NCHW")):
    """Average over spatial positions (tokens: over the non-prefix tokens) → new (B, C) float32.

    Vectors are copied (``copy=True``): the stored value must not alias the layer's output. A
    bf16/fp16 map is averaged in float32 without a float32 copy of the whole map (:func:`mean_f32`).
    """
    import torch

    dims = {"NLC": (1,), "NHWC": (1, 2)}.get(layout.kind, (2, 3) if out.ndim == 4 else None)
    if layout.kind == "NC" or out.ndim == 2 or dims is None:
        return out.to(torch.float32, copy=True).reshape(out.shape[0], -1)
    return mean_f32(out[:, layout.prefix:] if layout.kind == "NLC" else out, dims)


def grid_pool(out, layout: Layout, grid: int):
    """The map as NCHW float32, average-pooled to ``grid`` × ``grid`` (a new tensor); a half-precision
    map is converted a batch chunk at a time (at most ``POOL_CHUNK_BYTES`` of float32 at once)."""
    import torch

    x = to_nchw(out, layout)
    pool = torch.nn.functional.adaptive_avg_pool2d
    if x.dtype == torch.float32:
        return pool(x, grid)
    return _by_chunks(x, lambda c: pool(c, grid))


@dataclass(frozen=True)
class TapInfo:
    name: str
    module_type: str
    shape: tuple[int, ...]  # output shape without the batch dimension
    calls: int

    @property
    def width(self) -> int:
        """Channels under the shape-only guess (NCHW / tokens); use ``Layout.width`` for the truth."""
        return int(self.shape[0]) if len(self.shape) in (1, 3) else int(self.shape[-1])


class Tapper:
    """Hooks on ``names`` that store ``reduce(output)`` per name; usable as a context manager.

    ``reduce`` is one function for every tap or a mapping name → function.
    """

    def __init__(self, model, names: Sequence[str], reduce: Reduce | Mapping[str, Reduce] = spatial_mean,
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
        fn = self.reduce[name] if isinstance(self.reduce, Mapping) else self.reduce

        def hook(module, inputs, output):
            self.values[name] = fn(output)
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
            # per-image outputs only: a window-partitioned (Swin attention) or flattened output
            # whose first axis is not the batch cannot be a feature of one image
            if isinstance(output, torch.Tensor) and output.ndim >= 1 and output.shape[0] == 1:
                if name not in shapes:
                    order.append(name)
                shapes[name] = tuple(int(s) for s in output.shape[1:])
                calls[name] = calls.get(name, 0) + 1
        return hook

    handles = [modules[n].register_forward_hook(make(n)) for n in names if n in modules]
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, input_size, input_size, device="meta"))
    except Exception as exc:  # e.g. a ViT / Swin built for one input size
        raise ValueError(f"{type(model).__name__} does not run at input size {input_size}x{input_size} "
                         f"({type(exc).__name__}: {exc}); choose another --input-size") from exc
    finally:
        for h in handles:
            h.remove()
    return {n: TapInfo(n, type(modules[n]).__name__, shapes[n], calls[n]) for n in order}


def prefix_tokens(model, n_tokens: int) -> int:
    """Leading non-spatial tokens (class / register tokens) in a sequence of ``n_tokens``.

    timm ViTs say how many they have (``num_prefix_tokens``); a sequence counts them only if its
    length is that many plus the patch grid (the patch embedding's own output has none).
    """
    p = int(getattr(model, "num_prefix_tokens", 0) or 0)
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if p <= 0 or n_tokens <= p:
        return 0
    if grid is not None and n_tokens == p + math.prod(int(g) for g in grid):
        return p
    n = n_tokens - p  # another input size (dynamic_img_size): prefix + a square grid
    return p if math.isqrt(n) ** 2 == n and math.isqrt(n_tokens) ** 2 != n_tokens else 0


def _layout_from_shape(model, shape: tuple[int, ...]) -> Layout | None:
    if len(shape) == 1:
        return Layout("NC")
    if len(shape) == 2:
        return Layout("NLC", prefix_tokens(model, shape[0]))
    if len(shape) == 3:
        nchw, nhwc = shape[1] == shape[2], shape[0] == shape[1]
        if nchw != nhwc:
            return Layout("NCHW" if nchw else "NHWC")
    return None  # C == H == W, a non-square map, or another rank: not decidable from one shape


def _layout_from_two(shape: tuple[int, ...], other: tuple[int, ...]) -> Layout | None:
    """Channels keep their size when the input grows; positions change."""
    if len(shape) != 3 or len(other) != 3:
        return None
    if shape[0] == other[0] and shape[1:] != other[1:]:
        return Layout("NCHW")
    if shape[2] == other[2] and shape[:2] != other[:2]:
        return Layout("NHWC")
    return None


def detect_layouts(model, input_size: int, names: Sequence[str] | None = None,
                   info: Mapping[str, TapInfo] | None = None) -> dict[str, Layout | None]:
    """The layout of each layer's output (None: cannot be told), from meta-device forwards."""
    info = probe(model, input_size, names) if info is None else info
    out = {n: _layout_from_shape(model, i.shape) for n, i in info.items()}
    unsure = [n for n, v in out.items() if v is None and len(info[n].shape) == 3]
    if unsure:
        try:  # models with a fixed input size (Swin, ViT) refuse another size: stay unsure
            other = probe(model, input_size + 32, unsure)
        except Exception:
            other = {}
        for n in unsure:
            if n in other:
                out[n] = _layout_from_two(info[n].shape, other[n].shape)
    return out


def check_layout(model_name: str, info: TapInfo, layout: Layout | None) -> Layout:
    """``layout`` or a ValueError naming the layer: an unknown layout is refused, never guessed."""
    if layout is None:
        raise ValueError(f"cannot tell the layout (NCHW or NHWC) of {model_name} layer {info.name!r}, "
                         f"output {info.shape} at this input size; choose another --input-size or tap")
    return layout


def tap_columns(model_name: str, model, names: Sequence[str], input_size: int):
    """Each tap's ``{name, width, start, stop, layout, prefix}`` columns, the hook calls of a pass and
    the taps' :class:`TapInfo`. Widths are channels under the tap's detected layout (a Swin stage
    (H, W, C) is C wide)."""
    info = probe(model, input_size, names)
    missing = [n for n in names if n not in info]
    if missing:
        raise ValueError(f"layer {missing[0]!r} of {model_name} produces no per-image tensor (one row per image); list layers with --list-layers")
    layouts = detect_layouts(model, input_size, names, info={n: info[n] for n in names})
    cols, start = [], 0
    for n in names:
        lay = check_layout(model_name, info[n], layouts[n])
        w = lay.width(info[n].shape)
        cols.append({"name": n, "width": w, "start": start, "stop": start + w, "layout": lay.kind,
                     "prefix": lay.prefix})
        start += w
    return cols, sum(info[n].calls for n in names), info


def spatial_tap(model_name: str, model, name: str, input_size: int) -> tuple[dict, int, int]:
    """The map tap of grid / regions: its column dict, its square side and its hook calls.

    A layer whose output is not a square spatial map (NCHW, NHWC or a square token grid) is refused.
    """
    cols, calls, info = tap_columns(model_name, model, [name], input_size)
    col, shape = cols[0], info[name].shape
    side = Layout(col["layout"], col["prefix"]).side(shape)
    if col["layout"] == "NC" or side <= 0:
        raise ValueError(f"{model_name} layer {name!r} is not a square spatial map (output {shape}, "
                         f"layout {col['layout']}); --kind grid and regions need one")
    return col, side, calls


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
    layouts = detect_layouts(model, size, info=info)
    default = set(spec.fne_taps(model))
    rows = []
    for n, i in info.items():
        lay = layouts.get(n)
        rows.append({"name": n, "type": i.module_type, "shape": list(i.shape),
                     "width": lay.width(i.shape) if lay else i.width, "layout": lay.kind if lay else "?",
                     "default_tap": n in default, "calls": i.calls})
    return rows
