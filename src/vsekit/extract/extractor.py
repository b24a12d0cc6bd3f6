"""The extractor: batched crops → features, in ``inference_mode``, channels_last, normalised on the
device, with bf16/fp16 autocast on CUDA when asked.

``global``/``fne``: taps reduced to their spatial mean inside the hooks (Full-Network Embedding,
Vilalta et al.), concatenated in tap order and averaged over crops (10-crop protocol) unless crops
are kept. ``grid``: the last conv map average-pooled to G×G (SMAN: 14×14 → 7×7 by 2×2 pooling).
``regions``: RoIAlign of each box (from a file or ``--detector coco-frcnn``) on the last conv map,
averaged over its 7×7 samples; ImageNet-backbone features, not the bottom-up-attention ones
(those come from ``--detector butd-r101``, :mod:`.butd`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from ..devices import exact_float32
from .plan import Plan
from .taps import Layout, Tapper, grid_pool, spatial_mean, to_nchw
from .throughput import autocast, pin_memory as pinned, to_device

def tap_reducers(plan: Plan) -> dict:
    """Per tap, the function its hook applies: each works on the tap's own layout (NCHW, NHWC,
    tokens) and returns a new float32 tensor, never a view an in-place layer could overwrite."""
    out = {}
    for t in plan.taps:
        lay = Layout(t.get("layout", "NCHW"), int(t.get("prefix", 0)))
        if plan.kind == "grid":
            out[t["name"]] = lambda o, lay=lay, g=plan.grid: grid_pool(o, lay, g)
        elif plan.kind == "regions":
            # the whole map as NCHW (RoIAlign needs it)
            out[t["name"]] = lambda o, lay=lay: to_nchw(o, lay).to(torch.float32, copy=True)
        else:
            out[t["name"]] = lambda o, lay=lay: spatial_mean(o, lay)
    return out


class Extractor:
    """Holds one built model and its hooks; call ``features`` on uint8 crops (B, n_crops, 3, H, W)."""

    def __init__(self, plan: Plan, device: str = "cpu", *, pin_memory: str | bool = "auto",
                 channels_last: bool = True):
        from .backbones import build_model   # looked up when called (tests cache builds through it)

        self.plan = plan
        self.device = torch.device(device)
        exact_float32()   # --precision fp32 is IEEE float32 on CUDA (no TF32), in this worker process
        self.pinned = pinned(pin_memory, str(self.device))  # throughput options (throughput.py)
        self.layout = torch.channels_last if channels_last else torch.contiguous_format
        self.model = build_model(plan.model, plan.weights, seed=plan.seed, device=str(self.device))
        self.model = self.model.to(memory_format=self.layout)
        self.mean = torch.tensor(plan.mean, device=self.device).view(1, 3, 1, 1) * 255.0
        self.std = torch.tensor(plan.std, device=self.device).view(1, 3, 1, 1) * 255.0
        self.tapper = Tapper(self.model, plan.tap_names, tap_reducers(plan), total_calls=plan.tap_calls)
        self.detector = None
        self._inputs = None   # the CPU's float32 input buffers (_normalise): one batch's size per thread
        self.pid = os.getpid()

    def _normalise(self, x):
        x = to_device(x, self.device, self.pinned)
        if x.device.type == "cpu":   # a float32 input buffer kept per thread: no fresh pages to fault in per batch
            import threading

            buffers = self._inputs if self._inputs is not None else {}
            self._inputs = buffers
            me = threading.get_ident()
            buf = buffers.get(me)
            if buf is None or buf.shape != x.shape or buf.stride() != x.stride():
                buf = buffers[me] = torch.empty_like(x, dtype=torch.float32)
            x = buf.copy_(x)   # ours: normalised in place
        else:
            x = x.to(torch.float32, copy=True)   # ours: normalised in place (CUDA's allocator caches)
        hwc = x.permute(0, 2, 3, 1)
        if hwc.is_contiguous():   # the decoders' NHWC crops: rows of W*3 values, the mean and std tiled
            w, c = hwc.shape[2], hwc.shape[3]
            rows = hwc.view(-1, w * c)
            rows.sub_(self.mean.reshape(c).repeat(w)).div_(self.std.reshape(c).repeat(w))
        else:
            x.sub_(self.mean).div_(self.std)
        return x.contiguous(memory_format=self.layout)

    def forward(self, x) -> list[Any]:
        with torch.inference_mode(), autocast(self.device, self.plan.precision):
            return self.tapper.run(self.model, self._normalise(x))

    def features(self, crops) -> np.ndarray:
        """uint8 (B, n_crops, H, W, 3) from the decoders, or (B, n_crops, 3, H, W) → float32 (B, D),
        (B, n_crops, D) or (B, G, G, C). NHWC crops are read as a channels-last view (no copy); the
        two layouts cannot be confused because a crop is at least 8 pixels wide (plan.py)."""
        b, nc = crops.shape[:2]
        x = crops.reshape(b * nc, *crops.shape[2:])
        if x.shape[-1] == 3 and x.shape[1] != 3:   # NHWC
            x = x.permute(0, 3, 1, 2)
        outs = self.forward(x)
        if self.plan.kind == "grid":
            return outs[0].float().permute(0, 2, 3, 1).cpu().numpy()
        feats = torch.cat([o.float() for o in outs], dim=1).reshape(b, nc, -1)
        if not self.plan.keep_crops:
            feats = feats.mean(dim=1)
        return feats.cpu().numpy()

    def regions(self, image, boxes: list[np.ndarray]) -> np.ndarray:
        """uint8 (B, 1, 3, S, S) and boxes per image in input pixels → float32 (B, K, C)."""
        from torchvision.ops import roi_align

        b, k, c = image.shape[0], self.plan.max_regions, self.plan.channels
        fmap = self.forward(image[:, 0])[0].float()
        out = np.zeros((b, k, c), dtype=np.float32)
        rois = [torch.as_tensor(bx, dtype=torch.float32, device=self.device).reshape(-1, 4) for bx in boxes]
        if sum(len(r) for r in rois) == 0:
            return out
        scale = fmap.shape[-1] / float(image.shape[-1])
        with torch.inference_mode():
            pooled = roi_align(fmap, rois, output_size=7, spatial_scale=scale, sampling_ratio=2,
                               aligned=True).mean(dim=(2, 3))
        for j, p in enumerate(pooled.cpu().split([len(r) for r in rois])):
            out[j, :len(p)] = p.numpy()
        return out

    def detect(self, image) -> list[np.ndarray]:
        """Boxes of ``--detector coco-frcnn`` (torchvision's COCO Faster R-CNN) on the input images."""
        from .regions import build_detector, detect_boxes

        if self.detector is None:
            self.detector = build_detector(self.plan, self.device)
        return detect_boxes(self.detector, image[:, 0], self.device, self.plan.max_regions,
                            self.plan.min_regions)


# one extractor per process, keyed by plan and device: a dask worker builds its model once
_CACHE: dict[str, Extractor] = {}
BUILDS = {"count": 0}


def cached_extractor(plan: Plan, device: str, *, pin_memory: str | bool = "auto",
                     channels_last: bool = True) -> Extractor:
    key = json.dumps([plan.to_dict(), device, pin_memory, channels_last], sort_keys=True, default=str)
    if key not in _CACHE:
        _CACHE.clear()
        if plan.detector == "butd-r101":
            from .butd import ButdExtractor

            _CACHE[key] = ButdExtractor(plan, device)
        else:
            _CACHE[key] = Extractor(plan, device, pin_memory=pin_memory, channels_last=channels_last)
        BUILDS["count"] += 1
    return _CACHE[key]
