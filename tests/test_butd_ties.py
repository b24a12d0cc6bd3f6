"""BUTD's sorts and NMS with equal scores and IoUs at the threshold, against ports of the originals.

The originals (py-faster-rcnn's ``proposal_layer.py`` and Cython ``cpu_nms``, bottom-up-attention's
``generate_tsv.py``) sort with numpy's ``argsort()[::-1]`` and suppress at IoU >= threshold. With
real weights many RPN scores sit near 1 and tie; the order of equal scores then decides which boxes
survive NMS and the order of the proposals. The ports below are written from the original code:
``cpu_nms`` pair by pair with float32 scalars, as its Cython loop runs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vsekit.extract import butd_select as sel  # noqa: E402


def cpu_nms_port(dets: np.ndarray, thresh: float) -> list[int]:
    """py-faster-rcnn lib/nms/cpu_nms.pyx, line by line (float32 variables, ``ovr >= thresh``)."""
    x1, y1, x2, y2, scores = (dets[:, k].astype(np.float32) for k in range(5))
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = scores.argsort()[::-1]
    suppressed = np.zeros(len(dets), dtype=np.int64)
    keep = []
    for _i in range(len(dets)):
        i = order[_i]
        if suppressed[i] == 1:
            continue
        keep.append(int(i))
        ix1, iy1, ix2, iy2, iarea = x1[i], y1[i], x2[i], y2[i], areas[i]
        for _j in range(_i + 1, len(dets)):
            j = order[_j]
            if suppressed[j] == 1:
                continue
            xx1, yy1 = max(ix1, x1[j]), max(iy1, y1[j])
            xx2, yy2 = min(ix2, x2[j]), min(iy2, y2[j])
            w = max(np.float32(0.0), np.float32(xx2 - xx1 + np.float32(1)))
            h = max(np.float32(0.0), np.float32(yy2 - yy1 + np.float32(1)))
            inter = np.float32(w * h)
            ovr = np.float32(inter / np.float32(iarea + areas[j] - inter))
            if float(ovr) >= thresh:
                suppressed[j] = 1
    return keep


def proposal_order_port(boxes: np.ndarray, scores: np.ndarray, pre_nms: int, post_nms: int, thresh: float):
    """proposal_layer.py steps 4-8: sort, keep pre_nms, NMS, keep post_nms (boxes already filtered)."""
    order = scores.ravel().argsort()[::-1][:pre_nms]
    boxes, scores = boxes[order], scores[order]
    keep = cpu_nms_port(np.hstack((boxes, scores[:, None])).astype(np.float32), thresh)[:post_nms]
    return order[keep]


def generate_tsv_port(cls_boxes: np.ndarray, scores: np.ndarray, min_boxes: int, max_boxes: int,
                      conf_thresh: float = 0.2, nms=0.3):
    """get_detections_from_im's selection (float64 max_conf, numpy argsort()[::-1])."""
    max_conf = np.zeros(cls_boxes.shape[0])
    for cls_ind in range(1, scores.shape[1]):
        cls_scores = scores[:, cls_ind]
        dets = np.hstack((cls_boxes, cls_scores[:, np.newaxis])).astype(np.float32)
        keep = np.array(cpu_nms_port(dets, nms), dtype=np.int64)
        max_conf[keep] = np.where(cls_scores[keep] > max_conf[keep], cls_scores[keep], max_conf[keep])
    keep_boxes = np.where(max_conf >= conf_thresh)[0]
    if len(keep_boxes) < min_boxes:
        keep_boxes = np.argsort(max_conf)[::-1][:min_boxes]
    elif len(keep_boxes) > max_boxes:
        keep_boxes = np.argsort(max_conf)[::-1][:max_boxes]
    return keep_boxes, max_conf


def tied_boxes(rng, n: int, levels: int):
    """Integer boxes (many exact IoUs) and float32 scores drawn from a few levels (many ties)."""
    xy = rng.integers(0, 80, (n, 2))
    wh = rng.integers(4, 40, (n, 2))
    boxes = np.concatenate([xy, xy + wh], 1).astype(np.float32)
    scores = (np.float32(1) - rng.integers(0, levels, n).astype(np.float32) * np.float32(1e-3)).astype(np.float32)
    return boxes, scores


def test_iou_exactly_at_the_threshold_is_suppressed():
    # inclusive pixels: inter 10 x 5 = 50, union 100 + 50 - 50 = 100: IoU exactly 0.5
    boxes = np.array([[0, 0, 9, 9], [0, 0, 9, 4]], dtype=np.float32)
    scores = np.array([0.9, 0.8], dtype=np.float32)
    dets = np.hstack((boxes, scores[:, None]))
    assert cpu_nms_port(dets, 0.5) == [0]
    assert sel.nms_caffe(torch.from_numpy(boxes), torch.from_numpy(scores), 0.5).tolist() == [0]
    assert sel.nms_caffe(torch.from_numpy(boxes), torch.from_numpy(scores), 0.5 + 1e-9).tolist() == [0, 1]


@pytest.mark.parametrize("seed,n,levels,thresh", [(0, 300, 6, 0.7), (1, 400, 3, 0.5), (2, 40, 2, 0.3),
                                                  (3, 600, 12, 0.25)])
def test_nms_with_ties_keeps_what_cpu_nms_keeps_in_its_order(seed, n, levels, thresh):
    boxes, scores = tied_boxes(np.random.default_rng(seed), n, levels)
    want = cpu_nms_port(np.hstack((boxes, scores[:, None])), thresh)
    got = sel.nms_caffe(torch.from_numpy(boxes), torch.from_numpy(scores), thresh).tolist()
    assert got == want
    limited = sel.nms_caffe(torch.from_numpy(boxes), torch.from_numpy(scores), thresh, limit=7).tolist()
    assert limited == want[:7]


def test_rpn_proposals_with_tied_scores_come_in_the_proposal_layers_order():
    """Quantised RPN logits: many fg scores are equal floats; the proposals (which anchors, in
    which order) must be the proposal layer's."""
    rng = np.random.default_rng(5)
    fh, fw, height, width, scale = 5, 7, 80, 112, 1.0
    logits = (rng.integers(-2, 3, (1, 24, fh, fw)) * 0.5).astype(np.float32)
    deltas = np.zeros((1, 48, fh, fw), dtype=np.float32)   # proposals = the (clipped) anchors
    boxes, scores = sel.rpn_proposals(torch.from_numpy(logits), torch.from_numpy(deltas), height, width,
                                      scale, pre_nms=300, post_nms=60, nms_thresh=0.7, min_size=16)

    # the port, from the same anchors: bbox_transform_inv with zero deltas (x2, y2 move by +1), clip, filter
    anchors = sel.shifted_anchors(fh, fw).numpy()
    w, h = anchors[:, 2] - anchors[:, 0] + 1, anchors[:, 3] - anchors[:, 1] + 1
    cx, cy = anchors[:, 0] + 0.5 * w, anchors[:, 1] + 0.5 * h
    clipped = np.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], 1).astype(np.float32)
    clipped[:, 0::2] = np.clip(clipped[:, 0::2], 0, width - 1)
    clipped[:, 1::2] = np.clip(clipped[:, 1::2], 0, height - 1)
    ok = np.where((clipped[:, 2] - clipped[:, 0] + 1 >= 16) & (clipped[:, 3] - clipped[:, 1] + 1 >= 16))[0]
    fg = torch.softmax(torch.stack([torch.from_numpy(logits[0, :12]), torch.from_numpy(logits[0, 12:])]), 0)[1]
    fg = fg.permute(1, 2, 0).reshape(-1).numpy()[ok]        # the scores as the network gives them
    assert len(np.unique(fg)) < len(fg) // 10                # mostly ties
    picked = ok[proposal_order_port(clipped[ok], fg, 300, 60, 0.7)]
    np.testing.assert_array_equal(boxes.numpy(), clipped[picked])
    np.testing.assert_array_equal(scores.numpy(), fg[np.searchsorted(ok, picked)])


@pytest.mark.parametrize("min_boxes,max_boxes,levels", [(10, 100, 4), (36, 36, 3), (50, 60, 2)])
def test_selection_with_ties_is_generate_tsvs(min_boxes, max_boxes, levels):
    rng = np.random.default_rng(min_boxes)
    r, classes = 70, 9
    boxes, _ = tied_boxes(rng, r, 2)
    # class probabilities from a few levels: equal scores within a class and across boxes
    raw = rng.integers(1, levels + 1, (r, classes)).astype(np.float64) ** 3
    prob = (raw / raw.sum(1, keepdims=True)).astype(np.float32)
    want_keep, want_conf = generate_tsv_port(boxes, prob, min_boxes, max_boxes)
    conf = sel.region_confidence(torch.from_numpy(boxes), torch.from_numpy(prob))
    keep = sel.select_regions(conf, min_boxes, max_boxes)
    np.testing.assert_array_equal(keep.numpy(), want_keep)
    np.testing.assert_array_equal(conf.numpy(), want_conf)
    assert conf.dtype == torch.float64

