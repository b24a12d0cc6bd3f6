"""``--detector butd-r101``: the BUTD Faster R-CNN against independent references.

- anchors against the table printed by py-faster-rcnn's generate_anchors.py;
- proposals and the generate_tsv.py selection against numpy re-implementations of the originals;
- the backbone and res5 against torchvision ResNet modules set to the Caffe architecture (stride
  in the 1x1 conv, ceil-mode pool1, dilated res5) with the same weights, and RoIPool in numpy;
- the checkpoint table (keys and shapes), loading it, and the errors of a wrong file;
- preprocessing against torch's own bilinear kernel with explicit scales.
All at the paper's sizes (1024-d res4, 2048-d pool5, 1,601 classes, 401 attributes) on random weights.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tv = pytest.importorskip("torchvision")

from vsekit.extract import butd, butd_model, butd_select as sel  # noqa: E402

torch.set_num_threads(2)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model():
    """The full detector, random weights and random (non-identity) frozen-norm statistics."""
    m = butd_model.init_random(butd_model.build_empty("cpu"), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, butd_model.FrozenBN):
                n = mod.weight.shape[0]
                mod.weight.mul_(torch.rand(n, generator=g) + 0.5)
                mod.bias.copy_(torch.randn(n, generator=g) * 0.1)
                mod.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
    return m


# --- anchors, proposals, selection ------------------------------------------------------------------
def test_anchors_match_py_faster_rcnn_table():
    # the 9 anchors printed in py-faster-rcnn's lib/rpn/generate_anchors.py (scales 8, 16, 32)
    table = [[-84, -40, 99, 55], [-176, -88, 191, 103], [-360, -184, 375, 199],
             [-56, -56, 71, 71], [-120, -120, 135, 135], [-248, -248, 263, 263],
             [-36, -80, 51, 95], [-80, -168, 95, 183], [-168, -344, 183, 359]]
    np.testing.assert_array_equal(sel.base_anchors(scales=(8, 16, 32)), table)
    a = sel.base_anchors()  # BUTD: scales 4, 8, 16, 32
    assert a.shape == (12, 4)
    np.testing.assert_array_equal(a[0], [-38, -16, 53, 31])    # ratio 0.5, scale 4: 92 x 48
    np.testing.assert_array_equal(a[5], [-56, -56, 71, 71])    # ratio 1, scale 8
    anchors = sel.shifted_anchors(2, 3).numpy()                # (h, w, a) order
    np.testing.assert_array_equal(anchors[(1 * 3 + 2) * 12 + 7], a[7] + [32, 16, 32, 16])


def _np_nms(boxes, scores, thresh):
    """py-faster-rcnn's NMS (inclusive-pixel IoU, numpy's argsort()[::-1], suppressed at IoU >= thresh
    as its Cython cpu_nms; tests/test_butd_ties.py ports that loop line by line)."""
    x1, y1, x2, y2 = boxes.T
    areas = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = scores.argsort()[::-1]
    keep = []
    while order.size > 0:
        i = order[0]
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x2[i], x2[order[1:]]) - np.maximum(x1[i], x1[order[1:]]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[order[1:]]) - np.maximum(y1[i], y1[order[1:]]) + 1)
        inter = w * h
        ovr = inter / (areas[i] + areas[order[1:]] - inter)
        order = order[np.where(ovr < thresh)[0] + 1]
    return np.asarray(keep, dtype=np.int64)


def _np_proposals(logits, deltas, height, width, scale):
    """proposal_layer.py (test phase) in numpy: anchors + shifts, decode, clip, filter, sort, NMS."""
    a = 12
    bg, fg = logits[0, :a], logits[0, a:]
    scores = (1.0 / (1.0 + np.exp(bg - fg))).transpose(1, 2, 0).reshape(-1)
    fh, fw = logits.shape[-2:]
    sx, sy = np.meshgrid(np.arange(fw) * 16, np.arange(fh) * 16)
    shifts = np.vstack((sx.ravel(), sy.ravel(), sx.ravel(), sy.ravel())).T
    anchors = (sel.base_anchors().reshape(1, a, 4) + shifts.reshape(-1, 1, 4)).reshape(-1, 4).astype(np.float32)
    d = deltas.transpose(0, 2, 3, 1).reshape(-1, 4)
    w = anchors[:, 2] - anchors[:, 0] + 1.0
    h = anchors[:, 3] - anchors[:, 1] + 1.0
    cx, cy = anchors[:, 0] + 0.5 * w, anchors[:, 1] + 0.5 * h
    pcx, pcy = d[:, 0] * w + cx, d[:, 1] * h + cy
    pw, ph = np.exp(d[:, 2]) * w, np.exp(d[:, 3]) * h
    boxes = np.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw, pcy + 0.5 * ph], 1)
    boxes[:, 0::2] = np.clip(boxes[:, 0::2], 0, width - 1)
    boxes[:, 1::2] = np.clip(boxes[:, 1::2], 0, height - 1)
    ok = np.where((boxes[:, 2] - boxes[:, 0] + 1 >= 16 * scale) & (boxes[:, 3] - boxes[:, 1] + 1 >= 16 * scale))[0]
    boxes, scores = boxes[ok], scores[ok]
    order = scores.argsort()[::-1][:6000]
    boxes, scores = boxes[order], scores[order]
    keep = _np_nms(boxes, scores, 0.7)[:300]
    return boxes[keep], scores[keep]


def test_rpn_proposals_match_the_proposal_layer():
    rng = np.random.default_rng(0)
    fh, fw, height, width, scale = 24, 32, 380, 510, 1.3
    logits = rng.normal(0, 2, (1, 24, fh, fw)).astype(np.float32)
    deltas = rng.normal(0, 0.3, (1, 48, fh, fw)).astype(np.float32)
    want_boxes, want_scores = _np_proposals(logits, deltas, height, width, scale)
    boxes, scores = sel.rpn_proposals(torch.from_numpy(logits), torch.from_numpy(deltas), height, width, scale)
    assert len(want_boxes) == 300 and boxes.shape == (300, 4)
    np.testing.assert_allclose(boxes.numpy(), want_boxes, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(scores.numpy(), want_scores, rtol=1e-5)


def _np_select(boxes, cls_prob, min_boxes, max_boxes):
    """generate_tsv.py's get_detections_from_im selection, in numpy."""
    max_conf = np.zeros(len(boxes))
    for c in range(1, cls_prob.shape[1]):
        s = cls_prob[:, c]
        keep = _np_nms(boxes, s, 0.3)
        max_conf[keep] = np.where(s[keep] > max_conf[keep], s[keep], max_conf[keep])
    keep = np.where(max_conf >= 0.2)[0]
    if len(keep) < min_boxes:
        keep = np.argsort(max_conf)[::-1][:min_boxes]
    elif len(keep) > max_boxes:
        keep = np.argsort(max_conf)[::-1][:max_boxes]
    return keep, max_conf


@pytest.mark.parametrize("min_boxes,max_boxes,sharp,common", [(10, 100, 9.0, 0), (36, 36, 4.0, 0), (2, 5, 9.0, 0),
                                                               (10, 100, 3.0, 12.0)])
def test_selection_matches_generate_tsv(min_boxes, max_boxes, sharp, common):
    rng = np.random.default_rng(int(sharp) + max_boxes)
    r = 48
    xy = rng.integers(0, 60, (r, 2)).astype(np.float64)       # small integer boxes: the +1 of
    wh = rng.integers(3, 30, (r, 2)).astype(np.float64)       # inclusive pixels moves many IoUs
    boxes = np.concatenate([xy, xy + wh], 1).astype(np.float32)
    logits = rng.normal(0, 1, (r, butd_model.NUM_CLASSES)) * sharp
    logits[:, 7] += common   # one class dominating every box: the confidences hinge on its NMS
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob = (prob / prob.sum(1, keepdims=True)).astype(np.float32)
    want_keep, want_conf = _np_select(boxes, prob, min_boxes, max_boxes)
    conf = sel.region_confidence(torch.from_numpy(boxes), torch.from_numpy(prob))
    keep = sel.select_regions(conf, min_boxes, max_boxes)
    np.testing.assert_allclose(conf.numpy(), want_conf, rtol=1e-6)
    np.testing.assert_array_equal(keep.numpy(), want_keep)


def test_nms_caffe_uses_inclusive_pixels():
    # inclusive pixels: IoU = 5*10 / (100 + 100 - 50) = 0.333 > 0.3, suppressed;
    # exclusive (x2 - x1) would give 4*9 / (81 + 81 - 36) = 0.286 and keep both
    boxes = torch.tensor([[0.0, 0.0, 9.0, 9.0], [5.0, 0.0, 14.0, 9.0]])
    assert sel.nms_caffe(boxes, torch.tensor([0.9, 0.8]), 0.3).tolist() == [0]
    assert sel.nms_caffe(boxes, torch.tensor([0.9, 0.8]), 0.34).tolist() == [0, 1]


def test_select_regions_hand_case():
    conf = torch.tensor([0.5, 0.1, 0.3, 0.25])
    assert sel.select_regions(conf, 1, 2).tolist() == [0, 2]        # 3 above 0.2 > max: best 2
    assert sel.select_regions(conf, 4, 10).tolist() == [0, 2, 3, 1]  # 3 < min: best 4
    assert sel.select_regions(conf, 2, 3).tolist() == [0, 2, 3]     # in range: proposal order


# --- network against torchvision modules with the same weights --------------------------------------
def _copy_block(mine, theirs):
    pairs = [("conv1", "conv1", "bn1"), ("conv2", "conv2", "bn2"), ("conv3", "conv3", "bn3")]
    with torch.no_grad():
        for src, conv, bn in pairs:
            getattr(theirs, conv).weight.copy_(getattr(mine, src).weight)
            norm = getattr(mine, src).norm
            tbn = getattr(theirs, bn)
            for k in ("weight", "bias", "running_mean", "running_var"):
                getattr(tbn, k).copy_(getattr(norm, k))
        if mine.shortcut is not None:
            theirs.downsample[0].weight.copy_(mine.shortcut.weight)
            for k in ("weight", "bias", "running_mean", "running_var"):
                getattr(theirs.downsample[1], k).copy_(getattr(mine.shortcut.norm, k))


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_backbone_matches_torchvision_resnet101_in_caffe_layout(model):
    with torch.device("meta"):
        ref = tv.models.resnet101(weights=None).eval()
    ref = ref.to_empty(device="cpu")   # every tensor used below is copied from the model
    ref.maxpool = torch.nn.MaxPool2d(3, stride=2, padding=0, ceil_mode=True)   # Caffe pool1
    for layer in (ref.layer2, ref.layer3):                                      # MSRA: stride in the 1x1
        layer[0].conv1.stride, layer[0].conv2.stride = (2, 2), (1, 1)
    with torch.no_grad():
        ref.conv1.weight.copy_(model.backbone.stem.conv1.weight)
        for k in ("weight", "bias", "running_mean", "running_var"):
            getattr(ref.bn1, k).copy_(getattr(model.backbone.stem.conv1.norm, k))
    for mine, theirs in ((model.backbone.res2, ref.layer1), (model.backbone.res3, ref.layer2),
                         (model.backbone.res4, ref.layer3)):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            _copy_block(a, b)
    x = torch.randn(1, 3, 101, 133)
    with torch.no_grad():
        got = model.backbone(x)
        want = ref.layer3(ref.layer2(ref.layer1(ref.maxpool(ref.relu(ref.bn1(ref.conv1(x)))))))
        ref.maxpool = torch.nn.MaxPool2d(3, stride=2, padding=1)                # torchvision's own pool1
        other = ref.layer3(ref.layer2(ref.layer1(ref.maxpool(ref.relu(ref.bn1(ref.conv1(x)))))))
    assert got.shape == want.shape == (1, 1024, 7, 9)
    assert _rel_err(got, want) < 1e-4
    assert _rel_err(other, want) > 1e-3   # the test sees the Caffe pooling


def _np_roi_pool(fmap, box, size=14, scale=1 / 16):
    """Caffe's ROIPoolingLayer forward for one box (C++ round: half away from zero)."""
    c, h, w = fmap.shape
    x1, y1, x2, y2 = [int(math.floor(abs(v * scale) + 0.5)) * (1 if v >= 0 else -1) for v in box]
    rw, rh = max(x2 - x1 + 1, 1), max(y2 - y1 + 1, 1)
    bw, bh = rw / size, rh / size
    out = np.zeros((c, size, size), dtype=fmap.dtype)
    for ph in range(size):
        hs = min(max(math.floor(ph * bh) + y1, 0), h)
        he = min(max(math.ceil((ph + 1) * bh) + y1, 0), h)
        for pw in range(size):
            ws = min(max(math.floor(pw * bw) + x1, 0), w)
            we = min(max(math.ceil((pw + 1) * bw) + x1, 0), w)
            if he > hs and we > ws:
                out[:, ph, pw] = fmap[:, hs:he, ws:we].max(axis=(1, 2))
    return out


def test_pooled_features_match_roipool_and_a_dilated_torchvision_res5(model):
    from torchvision.models.resnet import Bottleneck

    rng = np.random.default_rng(3)
    fmap = torch.from_numpy(rng.random((1, 1024, 20, 26), dtype=np.float32))
    rois = torch.tensor([[13.3, 40.7, 250.2, 301.9], [100.6, 2.2, 180.4, 90.1], [0.0, 0.0, 415.0, 319.0]])
    with torch.device("meta"):
        ref = torch.nn.Sequential(*[
            Bottleneck(1024 if i == 0 else 2048, 512, stride=1, dilation=2,
                       downsample=torch.nn.Sequential(torch.nn.Conv2d(1024, 2048, 1, bias=False),
                                                      torch.nn.BatchNorm2d(2048)) if i == 0 else None)
            for i in range(3)]).eval()
    ref = ref.to_empty(device="cpu")
    ref[0].conv2.dilation, ref[0].conv2.padding = (2, 2), (2, 2)  # Caffe res5a_branch2b is dilated too
    for a, b in zip(model.roi_heads.res5, ref):
        _copy_block(a, b)
    pooled = np.stack([_np_roi_pool(fmap[0].numpy(), r.tolist()) for r in rois])
    with torch.no_grad():
        want = ref(torch.from_numpy(pooled)).mean(dim=(2, 3))
        got = model.pooled_features(fmap, rois, chunk=2)
    assert got.shape == (3, 2048)
    assert _rel_err(got, want) < 1e-4


def test_heads_follow_the_prototxt(model):
    # in float64 (a copy of the heads): the 2,048-term float32 dot products of the logits round
    # differently per CPU and GEMM blocking by up to ~1e-5, the size of any useful float32 tolerance
    p = copy.deepcopy(model.roi_heads.box_predictor).double()
    pooled = torch.randn(6, 2048, dtype=torch.float64) * 3
    with torch.no_grad():
        logits, deltas, attr = p(pooled)
        want_logits = pooled @ p.cls_score.weight.T + p.cls_score.bias
        embed = p.cls_embed.weight[want_logits.argmax(1)]               # ArgMax over all 1,601
        hidden = torch.relu(torch.cat([pooled, embed], 1) @ p.attr_linear1.weight.T + p.attr_linear1.bias)
        want_attr = torch.softmax(hidden @ p.attr_linear2.weight.T + p.attr_linear2.bias, 1)
    assert logits.shape == (6, 1601) and deltas.shape == (6, 6404) and attr.shape == (6, 401)
    torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-12)
    # the attribute softmax runs in float32 whatever the input (so bf16 autocast keeps float32
    # probabilities): bounded by float32 rounding of a 401-term positive sum, 401 u < 5e-5 relative
    torch.testing.assert_close(attr, want_attr.float(), rtol=5e-5, atol=1e-9)


def test_detect_returns_selected_regions_in_original_pixels(model):
    det = butd.ButdDetector.__new__(butd.ButdDetector)
    det.device, det.model, det.precision = torch.device("cpu"), model, "fp32"
    det.min_boxes, det.max_boxes, det.target, det.max_size, det.post_nms = 2, 4, 160, 240, 8
    rgb = torch.from_numpy(np.random.default_rng(5).integers(0, 256, (3, 150, 210), dtype=np.uint8))
    boxes, pooled, cls_prob, attr_prob = det.forward(rgb)
    assert boxes.shape == (8, 4)
    r = det.select(boxes, pooled, cls_prob, attr_prob)
    assert 2 <= len(r.boxes) <= 4 and r.features.shape == (len(r.boxes), 2048)
    assert (r.boxes[:, :2] >= 0).all() and (r.boxes[:, 2] <= 210).all() and (r.boxes[:, 3] <= 150).all()
    # each kept box is a proposal; its feature is that proposal's pool5, recomputed from the box
    idx = [int(torch.nonzero((boxes - torch.from_numpy(b)).abs().sum(1) < 1e-4)[0]) for b in r.boxes]
    np.testing.assert_allclose(r.features, pooled[idx].numpy(), rtol=1e-5, atol=1e-4)
    x, s = butd.preprocess(rgb, 160, 240)
    with torch.no_grad():
        again = model.pooled_features(model.backbone(x), torch.from_numpy(r.boxes) * s)
    assert _rel_err(torch.from_numpy(r.features), again) < 1e-4
    np.testing.assert_array_equal(r.labels, cls_prob[idx, 1:].argmax(1).numpy())
    np.testing.assert_array_equal(r.attrs, attr_prob[idx, 1:].argmax(1).numpy())
    assert r.labels.dtype == np.int16 and (r.labels < 1600).all() and (r.attrs < 400).all()


# --- preprocessing ----------------------------------------------------------------------------------
def test_caffe_scale_hand_cases():
    assert butd.caffe_scale(480, 640) == 600 / 480          # shorter side to 600
    assert butd.caffe_scale(300, 1000) == 1.0               # longer side capped at 1000
    assert butd.caffe_scale(600, 1001) == 1000 / 1001        # round(1 x 1001) > 1000
    assert butd.caffe_scale(600, 1000.4) == 1.0              # round(1000.4) = 1000 is allowed


def test_resize_matches_bilinear_kernel_with_explicit_scale():
    x = torch.rand(3, 37, 53) * 255
    for s in (600 / 37, 0.61, 1.0, 0.5):
        oh, ow = round(37 * s), round(53 * s)
        want = torch.ops.aten.upsample_bilinear2d(x[None], [oh, ow], False, s, s)[0]
        torch.testing.assert_close(butd.resize_linear(x, s), want, rtol=1e-5, atol=1e-3)


def test_resize_is_opencvs_inter_linear_formula(float64):
    """Each output pixel d samples the source at (d + 0.5) / s - 0.5, clamped to [0, side - 1], and
    interpolates its two neighbours on each axis (cv2.resize's INTER_LINEAR, written out in float64)."""
    def axis(n_out, n_in, s):
        src = ((np.arange(n_out) + 0.5) / s - 0.5).clip(0, n_in - 1)
        i0 = np.floor(src).astype(int)
        return i0, np.minimum(i0 + 1, n_in - 1), src - i0

    x = np.random.default_rng(1).random((3, 29, 41)) * 255
    for s in (600 / 29, 0.61, 1.0, 0.5, 0.13):
        (y0, y1, wy), (x0, x1, wx) = axis(round(29 * s), 29, s), axis(round(41 * s), 41, s)
        rows = x[:, y0] * (1 - wy)[None, :, None] + x[:, y1] * wy[None, :, None]
        want = rows[:, :, x0] * (1 - wx) + rows[:, :, x1] * wx
        np.testing.assert_allclose(butd.resize_linear(torch.from_numpy(x), s).numpy(), want, rtol=1e-9, atol=1e-7)


def test_preprocess_is_bgr_minus_caffe_means():
    rgb = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 600, 700), dtype=np.uint8))
    x, s = butd.preprocess(rgb)
    assert s == 1.0 and x.shape == (1, 3, 600, 700)
    want = rgb.numpy()[::-1].astype(np.float32) - np.array([102.9801, 115.9465, 122.7717], np.float32)[:, None, None]
    np.testing.assert_allclose(x[0].numpy(), want, atol=1e-4)


# --- the converted checkpoint -----------------------------------------------------------------------
# A few rows of the key/shape table, written out by hand from the prototxt (docs/extract.md has all).
TABLE_ROWS = {
    "backbone.stem.conv1.weight": (64, 3, 7, 7),
    "backbone.res2.0.shortcut.weight": (256, 64, 1, 1),
    "backbone.res3.0.conv1.weight": (128, 256, 1, 1),
    "backbone.res4.22.conv3.norm.running_var": (1024,),
    "proposal_generator.rpn_head.conv.weight": (512, 1024, 3, 3),
    "proposal_generator.rpn_head.objectness_logits.weight": (24, 512, 1, 1),
    "proposal_generator.rpn_head.anchor_deltas.weight": (48, 512, 1, 1),
    "roi_heads.res5.0.shortcut.weight": (2048, 1024, 1, 1),
    "roi_heads.res5.2.conv2.weight": (512, 512, 3, 3),
    "roi_heads.box_predictor.cls_score.weight": (1601, 2048),
    "roi_heads.box_predictor.bbox_pred.weight": (6404, 2048),
    "roi_heads.box_predictor.cls_embed.weight": (1601, 256),
    "roi_heads.box_predictor.attr_linear1.weight": (512, 2304),
    "roi_heads.box_predictor.attr_linear2.weight": (401, 512),
}


def test_checkpoint_table():
    table = butd_model.checkpoint_table()
    for k, shape in TABLE_ROWS.items():
        assert table[k] == shape, k
    assert len([k for k in table if k.startswith("backbone.res4.") and k.endswith("conv1.weight")]) == 23
    assert sum(math.prod(s) for k, s in table.items() if not k.endswith(("running_mean", "running_var"))) > 60e6


def _synthetic_checkpoint():
    """Every key of the table with its shape, each tensor a distinct constant (stride-0 views keep
    the file small; torch.load gives them back as tensors of the full shape)."""
    return {k: torch.full((1,), float(i + 1)).expand(shape) for i, (k, shape) in
            enumerate(butd_model.checkpoint_table().items())}


def test_load_checkpoint_with_exactly_the_table(tmp_path):
    state = _synthetic_checkpoint()
    values = {k: float(v.flatten()[0]) for k, v in state.items()}
    wrapped = dict(state)
    wrapped["roi_heads.box_predictor.cls_embed.weight"] = torch.full((1,), values[
        "roi_heads.box_predictor.cls_embed.weight"]).expand(1602, 256)          # MILVLG's num_classes + 1
    wrapped["backbone.res4.0.conv1.norm.num_batches_tracked"] = torch.tensor(0)
    wrapped["pixel_mean"] = torch.tensor([102.9801, 115.9465, 122.7717]).view(3, 1, 1)
    path = tmp_path / "bua-caffe-frcn-r101_with_attributes.pth"
    torch.save({"model": wrapped}, path)
    m = butd_model.build_empty("cpu")
    butd.load_checkpoint(m, path)
    got = m.state_dict()
    assert set(got) == set(values)
    for k, v in values.items():
        assert got[k].shape == state[k].shape and bool((got[k] == v).all()), k


@pytest.mark.parametrize("change,match", [
    (lambda s: s.pop("roi_heads.box_predictor.attr_linear2.bias"),
     "missing keys: roi_heads.box_predictor.attr_linear2.bias"),
    (lambda s: s.__setitem__("roi_heads.box_predictor.cls_score.weight", torch.zeros(1600, 2048)),
     r"wrong shapes: roi_heads.box_predictor.cls_score.weight \(1600, 2048\) \(expected \(1601, 2048\)\)"),
    (lambda s: s.__setitem__("roi_heads.box_head.fc6.weight", torch.zeros(2)), "unknown keys: roi_heads.box_head.fc6"),
])
def test_load_checkpoint_refuses_another_file(tmp_path, change, match):
    state = _synthetic_checkpoint()
    change(state)
    path = tmp_path / "other.pth"
    torch.save(state, path)
    with pytest.raises(ValueError, match=match):
        butd.load_checkpoint(butd_model.build_empty("meta"), path)
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pth: cannot read it as a torch checkpoint"):
        butd.load_checkpoint(butd_model.build_empty("meta"), tmp_path / "junk.pth")
