"""``--detector butd-r101``: bottom-up-attention region features (Anderson et al., CVPR 2018) without
Caffe: the Visual Genome Faster R-CNN of :mod:`.butd_model`, the proposals and selection of
:mod:`.butd_select`, and the preprocessing of py-faster-rcnn's ``_get_image_blob`` (BGR minus the
Caffe means, the Caffe test scale, OpenCV's INTER_LINEAR). What is computed, step by step, and where
to get the converted Caffe checkpoint (:func:`load_checkpoint`): docs/extract.md, "Region features
(BUTD)".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import butd_select as sel

PIXEL_MEANS_BGR = (102.9801, 115.9465, 122.7717)
TARGET_SIZE = 600
MAX_SIZE = 1000
IGNORED_KEYS = ("pixel_mean", "pixel_std")   # detectron2 keeps the input normalisation as buffers
# detectron2 <= 0.2 saved the RPN's cell anchors as a buffer (BufferList): checked, then dropped
ANCHOR_KEY = "proposal_generator.anchor_generator.cell_anchors.0"


def check_anchor_buffer(anchors, path) -> None:
    """Refuse a checkpoint whose saved cell anchors are not the ones this detector computes.

    The RPN's 24 logits and 48 deltas belong to the 12 anchors in the order of py-faster-rcnn's
    ``generate_anchors`` (:func:`.butd_select.base_anchors`); a file saved with other anchors (other
    sizes, another order or centre) would be read with the wrong boxes, so it is a ValueError.
    """
    want = torch.as_tensor(sel.base_anchors(), dtype=torch.float64)
    got = anchors.detach().to("cpu", torch.float64)
    if tuple(got.shape) == tuple(want.shape) and torch.allclose(got, want, rtol=0, atol=1e-3):
        return
    rows = got.reshape(-1, got.shape[-1])[:2].tolist() if got.numel() and got.dim() else got.tolist()
    raise ValueError(f"--detector-weights {path}: its {ANCHOR_KEY} {tuple(got.shape)} is not the anchors this "
                     f"detector computes (py-faster-rcnn generate_anchors, scales 4, 8, 16, 32, ratios 0.5, 1, "
                     f"2, ratio-major, 12 x 4, starting {want[:2].tolist()}); the file starts {rows}")


def caffe_scale(height: int, width: int, target: int = TARGET_SIZE, max_size: int = MAX_SIZE) -> float:
    """py-faster-rcnn's test scale: shorter side to ``target`` unless the longer would pass ``max_size``."""
    scale = float(target) / min(height, width)
    if round(scale * max(height, width)) > max_size:
        scale = float(max_size) / max(height, width)
    return scale


def resize_linear(img, scale: float):
    """(C, H, W) float → (C, round(H·s), round(W·s)) by OpenCV's INTER_LINEAR with factor ``s``: each
    output pixel d samples the source at (d + 0.5) / s - 0.5, clamped to the image, between its two
    neighbours on each axis (no antialiasing when shrinking, as cv2.resize). That is torch's bilinear
    kernel given the scale itself rather than the ratio of the sizes."""
    size = [int(round(img.shape[1] * scale)), int(round(img.shape[2] * scale))]
    return torch.ops.aten.upsample_bilinear2d(img[None], size, False, scale, scale)[0]


def preprocess(rgb, target: int = TARGET_SIZE, max_size: int = MAX_SIZE):
    """uint8 RGB (3, H, W) → float (1, 3, h, w) mean-subtracted BGR at the Caffe scale, and the scale."""
    h, w = rgb.shape[-2:]
    scale = caffe_scale(h, w, target, max_size)
    mean = torch.tensor(PIXEL_MEANS_BGR, dtype=torch.float32, device=rgb.device).view(3, 1, 1)
    bgr = rgb.flip(0).float() - mean
    return resize_linear(bgr, scale)[None], scale


def load_checkpoint(model, path: str | Path) -> None:
    """Load the converted Caffe checkpoint at ``path`` into ``model`` (``torch.load(weights_only=True)``).

    Accepts a plain state dict or one under ``"model"`` / ``"state_dict"``, ``module.`` prefixes,
    and ignores ``num_batches_tracked`` and detectron2's ``pixel_mean``/``pixel_std`` buffers. The
    cell-anchor buffer of files saved by detectron2 <= 0.2 is compared with the computed anchors
    (:func:`check_anchor_buffer`, a ValueError if they differ) and dropped. A
    ``cls_embed`` with 1,602 rows (MILVLG builds ``Embedding(num_classes + 1)``) keeps its first
    1,601, the only rows an argmax over 1,601 classes can index. Any other missing, unknown or
    mis-shaped key is a ValueError naming it: a partial load would give silently wrong features.
    """
    from .backbones import read_state

    state = {}
    for k, v in read_state(path, "--detector-weights", "cannot read it as a torch checkpoint").items():
        if k.endswith("num_batches_tracked") or k in IGNORED_KEYS or not torch.is_tensor(v):
            continue
        if k == ANCHOR_KEY:
            check_anchor_buffer(v, path)
            continue
        state[k] = v
    want = model.state_dict()
    emb = "roi_heads.box_predictor.cls_embed.weight"
    if emb in state and state[emb].shape[0] == want[emb].shape[0] + 1:
        state[emb] = state[emb][:want[emb].shape[0]]
    missing = [k for k in want if k not in state]
    unknown = [k for k in state if k not in want]
    bad = [f"{k} {tuple(state[k].shape)} (expected {tuple(want[k].shape)})"
           for k in want if k in state and tuple(state[k].shape) != tuple(want[k].shape)]
    for what, items in (("missing keys", missing), ("unknown keys", unknown), ("wrong shapes", bad)):
        if items:
            more = f" and {len(items) - 5} more" if len(items) > 5 else ""
            raise ValueError(f"--detector-weights {path} is not the converted BUTD ResNet-101 checkpoint: "
                             f"{what}: {', '.join(items[:5])}{more} (see docs/extract.md)")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)


@dataclass
class Regions:
    """The kept regions of one image (K boxes)."""

    boxes: np.ndarray          # (K, 4) float32, original pixels, x1 y1 x2 y2
    features: np.ndarray       # (K, 2048) float32, pool5
    labels: np.ndarray         # (K,) int16, object class 0..1599
    label_scores: np.ndarray   # (K,) float32
    attrs: np.ndarray          # (K,) int16, attribute 0..399
    attr_scores: np.ndarray    # (K,) float32


class ButdDetector:
    """The BUTD detector on one device; :meth:`detect` runs one image (the original runs batch 1)."""

    def __init__(self, weights: str, device: str = "cpu", seed: int = 0, min_boxes: int = 36,
                 max_boxes: int = 36, precision: str = "fp32", target: int = TARGET_SIZE,
                 max_size: int = MAX_SIZE, post_nms: int = sel.RPN_POST_NMS):
        from ..devices import exact_float32
        from .butd_model import build_empty, init_random

        exact_float32()   # --precision fp32 is IEEE float32 on CUDA (no TF32), in this worker process
        self.device = torch.device(device)
        model = build_empty("cpu")
        if weights == "none":
            init_random(model, seed)
        else:
            load_checkpoint(model, weights)
        self.model = model.to(self.device).eval()
        self.min_boxes, self.max_boxes = int(min_boxes), int(max_boxes)
        self.precision, self.target, self.max_size, self.post_nms = precision, target, max_size, post_nms

    def forward(self, rgb):
        """uint8 RGB (3, H, W) → proposals (R, 4, original pixels), pool5 (R, 2048), class
        probabilities (R, 1601), attribute probabilities (R, 401); all proposals, before selection."""
        from .throughput import autocast

        with torch.inference_mode():
            x, scale = preprocess(rgb.to(self.device), self.target, self.max_size)
            with autocast(self.device, self.precision):
                fmap = self.model.backbone(x)
                logits, deltas = self.model.rpn(fmap)
            rois, _ = sel.rpn_proposals(logits, deltas, x.shape[-2], x.shape[-1], scale, post_nms=self.post_nms)
            with autocast(self.device, self.precision):
                pooled = self.model.pooled_features(fmap, rois)
                cls_logits, _, attr_prob = self.model.heads(pooled)
            cls_prob = torch.softmax(cls_logits.float(), dim=1)
        # float32 RoIs / the scale in float32, as generate_tsv.py's numpy (value-based casting) divides
        return rois / scale, pooled.float(), cls_prob, attr_prob.float()

    def detect(self, rgb) -> Regions:
        """The selected regions of one uint8 RGB image (3, H, W)."""
        return self.select(*self.forward(rgb))

    def select(self, boxes, pooled, cls_prob, attr_prob) -> Regions:
        """The regions kept from :meth:`forward`'s outputs by generate_tsv.py's selection."""
        with torch.inference_mode():
            conf = sel.region_confidence(boxes, cls_prob)
            keep = sel.select_regions(conf, self.min_boxes, self.max_boxes)
            lab_s, lab = cls_prob[keep, 1:].max(dim=1)
            att_s, att = attr_prob[keep, 1:].max(dim=1)

        def np_(t, dtype):
            return t.cpu().numpy().astype(dtype)

        return Regions(np_(boxes[keep], np.float32), np_(pooled[keep], np.float32), np_(lab, np.int16),
                       np_(lab_s, np.float32), np_(att, np.int16), np_(att_s, np.float32))


class ButdExtractor:
    """The runner's extractor for ``--detector butd-r101``: items of original images → regions."""

    def __init__(self, plan, device: str = "cpu"):
        self.plan = plan
        # module constants read here, so a test can shrink the scale and the proposal count
        self.detector = ButdDetector(plan.detector_weights, device, seed=plan.seed, min_boxes=plan.min_regions,
                                     max_boxes=plan.max_regions, precision=plan.precision, target=TARGET_SIZE,
                                     max_size=MAX_SIZE, post_nms=sel.RPN_POST_NMS)

    def put_items(self, items, buf) -> None:
        """Detect each item's image and put its regions into the block buffer: features padded to
        ``max_regions`` rows, and each box's label, attribute and their scores (:func:`.regions.region_arrays`)."""
        for it in items:
            r = self.detector.detect(torch.from_numpy(it.crops[0]))
            feats = np.zeros((self.plan.max_regions, r.features.shape[1]), dtype=np.float32)
            feats[:len(r.features)] = r.features
            buf.put(it.row, feats, boxes=r.boxes)
            for name in ("labels", "label_scores", "attrs", "attr_scores"):
                buf.extra[name][it.row - buf.block.start, :len(r.boxes)] = getattr(r, name)


def butd_plan(*, detector_weights: str, seed: int, max_regions: int, min_regions: int | None,
              precision: str, store_dtype: str | None, unused: dict | None = None) -> dict:
    """The fields of the extraction plan of ``--detector butd-r101`` (the ``--model``/``--weights``
    backbone is unused); :func:`vsekit.extract.plan.make_plan` makes the ``Plan`` of them, so this
    module needs nothing of the planner.

    ``unused``: preprocessing options the caller set; BUTD has its own (Caffe scale), so any set
    one is a ValueError rather than silently ignored.
    """
    given = [k for k, v in (unused or {}).items() if v is not None]
    if given:
        raise ValueError(f"--detector butd-r101 does its own preprocessing (BGR minus Caffe means, shorter "
                         f"side {TARGET_SIZE}, longer <= {MAX_SIZE}); drop {', '.join(given)}")

    min_regions = max_regions if min_regions is None else int(min_regions)
    if max_regions < 1 or not 0 <= min_regions <= max_regions:
        raise ValueError(f"--min-regions {min_regions} / --max-regions {max_regions}: need "
                         f"0 <= min <= max and max >= 1 (BUTD: 10 and 100, or 36 and 36)")
    store_dtype = store_dtype or "float16"
    tap = {"name": "roi_heads.res5 (mean of 14x14)", "width": 2048, "start": 0, "stop": 2048}
    settings = {"pixel_means_bgr": list(PIXEL_MEANS_BGR), "scale": f"shorter {TARGET_SIZE}, longer <= {MAX_SIZE}",
                "rpn": {"pre_nms": sel.RPN_PRE_NMS, "post_nms": sel.RPN_POST_NMS, "nms": sel.RPN_NMS,
                        "min_size": sel.RPN_MIN_SIZE}, "class_nms": sel.CLASS_NMS,
                "conf_thresh": sel.CONF_THRESH}
    return dict(model="butd-r101", kind="regions", weights=detector_weights, seed=int(seed), crops=1,
                keep_crops=False, resize=TARGET_SIZE, resize_mode="caffe", crop_size=MAX_SIZE,
                mean=PIXEL_MEANS_BGR, std=(1.0, 1.0, 1.0), interpolation="bilinear", precision=precision,
                taps=(tap,), tap_calls=0, channels=2048, boxes="detector", max_regions=int(max_regions),
                min_regions=min_regions, store_dtype=store_dtype, detector="butd-r101",
                detector_weights=detector_weights, extra={"butd": settings})
