"""Proposals and region selection of the bottom-up-attention detector (Anderson et al., "Bottom-up
and top-down attention for image captioning and VQA", CVPR 2018), in torch/torchvision ops.

The Caffe model was trained with py-faster-rcnn's conventions, which these functions keep:

- boxes are inclusive pixel boxes: width = x2 - x1 + 1 (also inside NMS, see :func:`nms_caffe`);
- 12 anchors per cell of the stride-16 map, from ``generate_anchors`` with scales (4, 8, 16, 32)
  and ratios (0.5, 1, 2), ratio-major, sides rounded half-to-even as numpy does;
- the RPN's 24 objectness channels are 12 background logits then 12 foreground logits, and a
  proposal's score is the softmax of its (background, foreground) pair;
- test-time proposals: decode the deltas (no clamp), clip to the scaled image, drop boxes with a
  side under 16 original pixels, keep the 6000 best, NMS at 0.7, keep 300;
- region selection (``tools/generate_tsv.py``): per-class NMS at 0.3 over the *unregressed*
  proposals in original pixels, each proposal scored by its highest confidence among the classes
  whose NMS kept it, keep those >= 0.2, at least ``min_boxes`` and at most ``max_boxes`` by that
  score (10-100, or a fixed 36 with min = max = 36).
"""

from __future__ import annotations

import numpy as np

ANCHOR_SCALES = (4, 8, 16, 32)
ANCHOR_RATIOS = (0.5, 1.0, 2.0)
FEAT_STRIDE = 16
RPN_PRE_NMS = 6000
RPN_POST_NMS = 300
RPN_NMS = 0.7
RPN_MIN_SIZE = 16
CLASS_NMS = 0.3
CONF_THRESH = 0.2


def base_anchors(base: int = FEAT_STRIDE, ratios=ANCHOR_RATIOS, scales=ANCHOR_SCALES) -> np.ndarray:
    """(A, 4) anchors of one cell, ratio-major, as py-faster-rcnn's ``generate_anchors``."""
    ctr = 0.5 * (base - 1)
    out = []
    for r in ratios:
        ws = np.round(np.sqrt(base * base / r))
        hs = np.round(ws * r)
        for s in scales:
            w, h = ws * s, hs * s
            out.append([ctr - 0.5 * (w - 1), ctr - 0.5 * (h - 1), ctr + 0.5 * (w - 1), ctr + 0.5 * (h - 1)])
    return np.asarray(out, dtype=np.float64)


def shifted_anchors(height: int, width: int, device=None):
    """(H*W*A, 4) float32 anchors of an H×W map, ordered (h, w, a) like the RPN's outputs."""
    import torch

    base = torch.as_tensor(base_anchors(), dtype=torch.float32, device=device)
    sy, sx = torch.meshgrid(torch.arange(height, device=device, dtype=torch.float32) * FEAT_STRIDE,
                            torch.arange(width, device=device, dtype=torch.float32) * FEAT_STRIDE,
                            indexing="ij")
    shifts = torch.stack([sx, sy, sx, sy], dim=-1).reshape(-1, 1, 4)
    return (shifts + base.view(1, -1, 4)).reshape(-1, 4)


def decode_boxes(boxes, deltas):
    """Apply (dx, dy, dw, dh) deltas to inclusive boxes (py-faster-rcnn ``bbox_transform_inv``)."""
    import torch

    w = boxes[:, 2] - boxes[:, 0] + 1.0
    h = boxes[:, 3] - boxes[:, 1] + 1.0
    cx = boxes[:, 0] + 0.5 * w
    cy = boxes[:, 1] + 0.5 * h
    pcx = deltas[:, 0] * w + cx
    pcy = deltas[:, 1] * h + cy
    pw = torch.exp(deltas[:, 2]) * w
    ph = torch.exp(deltas[:, 3]) * h
    return torch.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], dim=1)


def clip_boxes(boxes, height: int, width: int):
    """Clip x to [0, width-1] and y to [0, height-1] (inclusive pixel boxes)."""
    b = boxes.clone()
    b[:, 0::2] = b[:, 0::2].clamp(0, width - 1)
    b[:, 1::2] = b[:, 1::2].clamp(0, height - 1)
    return b


def nms_caffe(boxes, scores, threshold: float):
    """NMS with inclusive-pixel IoU (areas (x2-x1+1)(y2-y1+1)), as py-faster-rcnn's ``nms``.

    torchvision's ``nms`` on boxes whose far corner is moved by +1 computes exactly that IoU.
    """
    from torchvision.ops import nms

    shifted = boxes.clone()
    shifted[:, 2:] += 1.0
    return nms(shifted, scores, threshold)


def rpn_proposals(logits, deltas, height: int, width: int, scale: float, *, pre_nms: int = RPN_PRE_NMS,
                  post_nms: int = RPN_POST_NMS, nms_thresh: float = RPN_NMS, min_size: float = RPN_MIN_SIZE):
    """Test-time proposals of one image: (R, 4) boxes in scaled-image pixels and their scores.

    ``logits`` (1, 2A, H', W') and ``deltas`` (1, 4A, H', W') are the RPN outputs on the stride-16
    map of the ``height`` × ``width`` scaled image; ``scale`` is its factor over the original.
    """
    import torch

    a = logits.shape[1] // 2
    fh, fw = logits.shape[-2:]
    pair = torch.stack([logits[0, :a], logits[0, a:]], dim=0).float()    # (2, A, H', W')
    fg = torch.softmax(pair, dim=0)[1].permute(1, 2, 0).reshape(-1)       # (H'*W'*A,) in (h, w, a)
    d = deltas[0].float().permute(1, 2, 0).reshape(-1, 4)                 # channels 4a..4a+3 per anchor
    boxes = clip_boxes(decode_boxes(shifted_anchors(fh, fw, logits.device), d), height, width)
    ws = boxes[:, 2] - boxes[:, 0] + 1
    hs = boxes[:, 3] - boxes[:, 1] + 1
    ok = torch.nonzero((ws >= min_size * scale) & (hs >= min_size * scale)).squeeze(1)
    boxes, fg = boxes[ok], fg[ok]
    order = torch.argsort(fg, descending=True, stable=True)[:pre_nms]
    boxes, fg = boxes[order], fg[order]
    keep = nms_caffe(boxes, fg, nms_thresh)[:post_nms]
    return boxes[keep], fg[keep]


def region_confidence(boxes, cls_prob, nms_thresh: float = CLASS_NMS):
    """(R,) each proposal's highest class probability among the classes whose NMS kept it.

    ``cls_prob`` (R, C) includes the background in column 0, which is skipped; ``boxes`` are in
    original pixels, where generate_tsv.py runs this NMS (inclusive-pixel IoU is not scale-free).
    """
    import torch

    conf = torch.zeros(boxes.shape[0], dtype=torch.float32, device=boxes.device)
    if boxes.shape[0] == 0:
        return conf
    probs = cls_prob.float()
    for c in range(1, probs.shape[1]):
        s = probs[:, c]
        keep = nms_caffe(boxes, s, nms_thresh)
        conf[keep] = torch.maximum(conf[keep], s[keep])
    return conf


def select_regions(conf, min_boxes: int, max_boxes: int, conf_thresh: float = CONF_THRESH):
    """Indices of the kept proposals, as generate_tsv.py: those with ``conf >= conf_thresh`` in
    proposal order; if fewer than ``min_boxes`` or more than ``max_boxes``, the best ``min_boxes`` /
    ``max_boxes`` by confidence instead (ties: earlier proposal first)."""
    import torch

    keep = torch.nonzero(conf >= conf_thresh).squeeze(1)
    if len(keep) < min_boxes or len(keep) > max_boxes:
        order = torch.argsort(conf, descending=True, stable=True)
        keep = order[:min_boxes] if len(keep) < min_boxes else order[:max_boxes]
    return keep
