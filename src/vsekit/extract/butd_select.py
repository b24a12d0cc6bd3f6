"""Proposals and region selection of the bottom-up-attention detector (Anderson et al., "Bottom-up
and top-down attention for image captioning and VQA", CVPR 2018), in torch and numpy, with
py-faster-rcnn's conventions: inclusive-pixel boxes, numpy's ``argsort()[::-1]`` for every
descending sort, its Cython ``cpu_nms`` (float32 IoU, suppressed at ``>=``), 12 anchors per
stride-16 cell, the RPN's (background, foreground) logit pairs, and ``tools/generate_tsv.py``'s
selection. Each step and why: docs/extract.md, "What is computed" and "Sorting and NMS as the
original".
"""

from __future__ import annotations

import numpy as np
import torch

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
    base = torch.as_tensor(base_anchors(), dtype=torch.float32, device=device)
    sy, sx = torch.meshgrid(torch.arange(height, device=device, dtype=torch.float32) * FEAT_STRIDE,
                            torch.arange(width, device=device, dtype=torch.float32) * FEAT_STRIDE,
                            indexing="ij")
    shifts = torch.stack([sx, sy, sx, sy], dim=-1).reshape(-1, 1, 4)
    return (shifts + base.view(1, -1, 4)).reshape(-1, 4)


def decode_boxes(boxes, deltas):
    """Apply (dx, dy, dw, dh) deltas to inclusive boxes (py-faster-rcnn ``bbox_transform_inv``)."""
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


def descending(scores) -> np.ndarray:
    """Indices of ``scores`` (a numpy array) from the highest, as the originals sort: numpy's own
    ``argsort()[::-1]``, so equal scores come out in the order numpy's (unstable) sort gives them,
    reversed, not in index order. The dtype matters (float32 scores, float64 confidences)."""
    return np.ascontiguousarray(np.argsort(scores)[::-1])


def _as_numpy(t, dtype) -> np.ndarray:
    return t.detach().to("cpu").numpy().astype(dtype, copy=False)


def _iou(boxes: np.ndarray, i, j) -> np.ndarray:
    """float32 IoUs of boxes ``i`` and ``j`` of (R, 4) ``boxes`` (index arrays that broadcast),
    computed term by term as ``cpu_nms`` computes each pair's: inclusive-pixel areas in float32."""
    one, zero = np.float32(1), np.float32(0)
    x1, y1, x2, y2 = (np.ascontiguousarray(boxes[:, k], dtype=np.float32) for k in range(4))
    areas = (x2 - x1 + one) * (y2 - y1 + one)
    w = np.maximum(zero, np.minimum(x2[i], x2[j]) - np.maximum(x1[i], x1[j]) + one)
    h = np.maximum(zero, np.minimum(y2[i], y2[j]) - np.maximum(y1[i], y1[j]) + one)
    inter = w * h
    return inter / (areas[i] + areas[j] - inter)


def _greedy_nms(boxes: np.ndarray, order: np.ndarray, threshold: float, limit: int | None) -> np.ndarray:
    """``cpu_nms`` on float32 (R, 4) boxes taken in ``order``: the first ``limit`` kept indices.

    Each kept box drops the later boxes whose float32 IoU with it is >= ``threshold`` (compared in
    float64, as the Cython code compares its float32 IoU with a Python float). Stopping after
    ``limit`` kept boxes gives the same first ``limit`` as running to the end.
    """
    boxes = np.ascontiguousarray(boxes, dtype=np.float32)
    keep = []
    order = np.asarray(order, dtype=np.int64)
    while order.size and (limit is None or len(keep) < limit):
        i, rest = order[0], order[1:]
        keep.append(i)
        order = rest[_iou(boxes, i, rest).astype(np.float64) < float(threshold)]
    return np.asarray(keep, dtype=np.int64)


def nms_caffe(boxes, scores, threshold: float, limit: int | None = None):
    """py-faster-rcnn's ``cpu_nms``: inclusive-pixel IoU (areas (x2-x1+1)(y2-y1+1)) in float32,
    boxes taken in numpy's ``argsort()[::-1]`` order of the float32 scores, a box suppressed at
    IoU >= ``threshold``; the kept indices in that order (the first ``limit`` of them), on the
    boxes' device. Runs in numpy on the CPU, as the original does."""
    b = _as_numpy(boxes, np.float32)
    keep = _greedy_nms(b, descending(_as_numpy(scores, np.float32)), threshold, limit)
    return torch.as_tensor(keep, dtype=torch.int64, device=boxes.device)


def nms_kept_per_column(boxes: np.ndarray, scores: np.ndarray, threshold: float) -> np.ndarray:
    """(R, C) bool: box r kept by ``cpu_nms`` over the R boxes scored by column c of ``scores``.

    The same as C separate ``cpu_nms`` calls, done for all columns at once: the pairwise
    suppressions (IoU >= threshold) are packed into bits once, then the greedy pass walks the
    ranks, each column in its own numpy ``argsort()[::-1]`` order.
    """
    r, c = scores.shape
    if r == 0:
        return np.zeros((0, c), dtype=bool)
    idx = np.arange(r)
    suppress = _iou(boxes, idx[:, None], idx[None]).astype(np.float64) >= float(threshold)
    words = (r + 63) // 64
    packed = np.zeros((r, words * 8), dtype=np.uint8)
    packed[:, :(r + 7) // 8] = np.packbits(suppress, axis=1, bitorder="little")
    packed = packed.view("<u8")                                     # (R, words): bit j of row i
    order = np.argsort(scores, axis=0)[::-1]                         # (R, C): per column, as descending()
    suppressed = np.zeros((c, words), dtype="<u8")
    kept = np.zeros((r, c), dtype=bool)
    cols = np.arange(c)
    for rank in range(r):
        idx = order[rank]
        bit = (suppressed[cols, idx >> 6] >> (idx & 63).astype("<u8")) & np.uint64(1)
        alive = bit == 0
        kept[idx, cols] = alive
        suppressed[alive] |= packed[idx[alive]]
    return kept


def rpn_proposals(logits, deltas, height: int, width: int, scale: float, *, pre_nms: int = RPN_PRE_NMS,
                  post_nms: int = RPN_POST_NMS, nms_thresh: float = RPN_NMS, min_size: float = RPN_MIN_SIZE):
    """Test-time proposals of one image: (R, 4) boxes in scaled-image pixels and their scores.

    ``logits`` (1, 2A, H', W') and ``deltas`` (1, 4A, H', W') are the RPN outputs on the stride-16
    map of the ``height`` × ``width`` scaled image; ``scale`` is its factor over the original.
    """
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
    order = torch.as_tensor(descending(_as_numpy(fg, np.float32))[:pre_nms], device=fg.device)
    boxes, fg = boxes[order], fg[order]
    keep = nms_caffe(boxes, fg, nms_thresh, limit=post_nms)
    return boxes[keep], fg[keep]


def region_confidence(boxes, cls_prob, nms_thresh: float = CLASS_NMS):
    """(R,) float64: each proposal's highest class probability among the classes whose NMS kept it
    (0 if none did), as generate_tsv.py's ``max_conf``.

    ``cls_prob`` (R, C) includes the background in column 0, which is skipped; ``boxes`` are in
    original pixels, where generate_tsv.py runs this NMS (inclusive-pixel IoU is not scale-free).
    """
    if boxes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=boxes.device)
    probs = _as_numpy(cls_prob, np.float32)[:, 1:]
    kept = nms_kept_per_column(_as_numpy(boxes, np.float32), probs, nms_thresh)
    conf = np.where(kept, probs, np.float32(0)).max(axis=1).astype(np.float64)
    return torch.from_numpy(conf).to(boxes.device)


def select_regions(conf, min_boxes: int, max_boxes: int, conf_thresh: float = CONF_THRESH):
    """Indices of the kept proposals, as generate_tsv.py: those with ``conf >= conf_thresh`` in
    proposal order; if fewer than ``min_boxes`` or more than ``max_boxes``, the best ``min_boxes`` /
    ``max_boxes`` by numpy's ``argsort()[::-1]`` of the float64 confidences instead (equal
    confidences in numpy's order, as the original)."""
    c = _as_numpy(conf, np.float64)
    keep = np.nonzero(c >= conf_thresh)[0]
    if len(keep) < min_boxes or len(keep) > max_boxes:
        keep = descending(c)[:min_boxes if len(keep) < min_boxes else max_boxes]
    return torch.as_tensor(keep, dtype=torch.int64, device=conf.device)
