"""``--decoder nvjpeg``: JPEGs decoded on the GPU, a batch at a time (issue 47, part 1).

The decoding workers only read each JPEG and its header (:func:`encoded`); the driving process
decodes the batch with one ``torchvision.io.decode_jpeg(list, device=...)`` call and orients, resizes
and cuts the crops on the device (:func:`batch_crops`); anything else is decoded as under
``torchvision``. On the CPU this gives exactly the ``torchvision`` decoder's crops; on a GPU nvjpeg's
pixels may differ, within :data:`TOLERANCE` (docs/extract.md, "Decoding on the GPU").
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .images import (ImageError, TORCH_RESIZE, budgeted_size, cut, decode_crops, decoded_cost, oriented,
                     pixel_budgets)

#: nvjpeg's features against the CPU decoders', relative per image (what gpu_check verifies on a GPU)
TOLERANCE = 1e-2

NEEDS_CUDA = "--decoder nvjpeg decodes on the GPU and needs --device cuda (this run's device is {device}); " \
             "use --decoder torchvision on the CPU"


def check_device(device: str) -> None:
    """Refuse ``--decoder nvjpeg`` on a device other than CUDA, in one line."""
    if not str(device).startswith("cuda"):
        raise ValueError(NEEDS_CUDA.format(device=device))


@dataclass
class Encoded:
    """A JPEG's bytes as a worker hands them over, with what the header says."""
    path: str
    data: np.ndarray        # uint8 (n,): the file
    orientation: int        # EXIF 1..8
    size: tuple[int, int]   # (w, h) after orientation


def encoded(path: str, plan, data: bytes | None = None) -> Encoded | None:
    """The file at ``path`` (or an image inside a shard; ``data``: its bytes, fetched already from
    object storage by the batch's ranged GETs) as an :class:`Encoded`, if it is an RGB or grayscale
    JPEG within the decoded pixel budget; None for any other file (the worker decodes it). An image
    over the resized budget raises ImageError with the CPU decoders' message."""
    from ..storage.sources import shards

    if plan.interpolation not in TORCH_RESIZE:
        return None   # nearest / lanczos: PIL's resize, in the worker
    if data is None and shards.is_ref(path):
        data = shards.read_bytes(path)
    elif data is None and os.path.isfile(path):
        data = Path(path).read_bytes()
    if not data:
        return None   # missing or empty: the CPU path says what is wrong
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                if img.format != "JPEG" or img.mode not in ("RGB", "L"):
                    return None
                budget = pixel_budgets(plan.setting("max_decoded_pixels"))[0]
                if decoded_cost(img.size, img.mode) > budget:
                    return None   # the CPU path refuses it with its message
                orientation = int(img.getexif().get(0x0112, 1) or 1)
                size = img.size[::-1] if orientation in (5, 6, 7, 8) else img.size
    except Exception:   # noqa: BLE001 - anything PIL cannot read: the CPU path gives its message
        return None
    budgeted_size(*size, plan.resize, plan.resize_mode, plan.setting("max_resized_pixels"))
    return Encoded(str(path), np.frombuffer(data, dtype=np.uint8), orientation, size)


def _resized(hwc, new: tuple[int, int], interpolation: str):
    """torch's antialiased uint8 resize on the tensor's device; where that device has no uint8 kernel,
    in float32, rounded (at most one level from the uint8 kernel's rounding)."""
    import torch

    from .images import torch_resize

    if (int(hwc.shape[1]), int(hwc.shape[0])) == tuple(new):
        return hwc
    try:
        return torch_resize(hwc, new, interpolation)
    except (RuntimeError, NotImplementedError):
        t = hwc.permute(2, 0, 1)[None].float()
        out = torch.nn.functional.interpolate(t, size=(new[1], new[0]), mode=TORCH_RESIZE[interpolation],
                                              antialias=True, align_corners=False)
        return out.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0)


def _decode_all(items: list, device) -> list:
    """The CHW uint8 tensors of ``items``' JPEGs on ``device``: one batched call, or one by one where
    it refuses the batch (an entry is then None for a JPEG it refuses alone)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    raw = [torch.from_numpy(it.encoded.data.copy()) for it in items]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # torchvision 0.29: "use torchcodec"
        try:
            return list(decode_jpeg(raw, mode=ImageReadMode.RGB, device=device))
        except Exception:   # noqa: BLE001 - a corrupt JPEG fails the batch: each alone
            out = []
            for r in raw:
                try:
                    out.append(decode_jpeg(r, mode=ImageReadMode.RGB, device=device))
                except Exception:   # noqa: BLE001
                    out.append(None)
            return out


def batch_crops(items, ok: list, plan, device):
    """The crops of the ``ok`` items of a batch, in order, as one uint8 tensor (B, n_crops, H, W, 3) on
    ``device``: the encoded JPEGs decoded here in one batch, the workers' crops (``items.crops``) moved
    there. Returns (tensor or None, the items it holds, [(item, reason)] of those that failed)."""
    import torch

    device = torch.device(device)
    gpu = [it for it in ok if it.encoded is not None]
    decoded = dict(zip(map(id, gpu), _decode_all(gpu, device))) if gpu else {}
    cpu = iter(items.crops if getattr(items, "crops", None) is not None else
               [torch.from_numpy(it.crops) for it in ok if it.encoded is None])
    crops, kept, failed = [], [], []
    for it in ok:
        try:
            if it.encoded is None:
                crops.append(next(cpu).to(device))
            elif decoded[id(it)] is None:   # refused: decoded alone on the CPU, where PIL names the fault
                again = decode_crops(it.encoded.path, plan.resize, plan.crop_size, plan.crops, plan.resize_mode,
                                     plan.interpolation, "torchvision", plan.setting("max_decoded_pixels"),
                                     plan.setting("max_resized_pixels"), data=it.encoded.data.tobytes())
                crops.append(torch.from_numpy(again).to(device))
            else:
                hwc = oriented(decoded[id(it)].permute(1, 2, 0), it.encoded.orientation)
                new = budgeted_size(*it.encoded.size, plan.resize, plan.resize_mode, plan.setting("max_resized_pixels"))
                crops.append(cut(_resized(hwc, new, plan.interpolation), plan.crop_size, plan.crops))
            kept.append(it)
        except (ImageError, ValueError) as exc:
            failed.append((it, str(exc)))
    return (torch.stack(crops) if crops else None), kept, failed
