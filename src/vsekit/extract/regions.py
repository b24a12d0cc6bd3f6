"""Region boxes for ``--kind regions``: from a JSON file of boxes per image id, or from a detector
(``--detector``, with its own ``--detector-weights``): ``butd-r101`` (:mod:`.butd`, boxes *and*
features) or ``coco-frcnn`` (torchvision's COCO Faster R-CNN boxes, ``--model`` features by
RoIAlign: *not* BUTD features); ``--boxes detector`` is an alias of the latter. docs/extract.md,
"Region features (BUTD)".
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SCORE_THRESHOLD = 0.2
DETECTORS = ("butd-r101", "coco-frcnn")
DETECTOR_WEIGHTS = ("imagenet", "none")


def resolve_detector(boxes: str | None, detector: str | None, detector_weights: str | None):
    """(boxes, detector, detector_weights) checked and resolved; raises ValueError naming the option.

    ``detector_weights`` comes back as ``imagenet``, ``none`` or an absolute path; it defaults to
    ``imagenet`` for coco-frcnn and has no default for butd-r101 (its weights cannot be downloaded).
    """
    if boxes == "detector":
        detector = detector or "coco-frcnn"
    elif boxes and detector:
        raise ValueError(f"--boxes {boxes!r} and --detector {detector} both give the boxes; use one")
    elif detector:
        boxes = "detector"
    if detector is None:
        if detector_weights is not None:
            raise ValueError("--detector-weights needs --detector butd-r101|coco-frcnn")
        return boxes, None, None
    w = detector_weights
    if w is None:
        if detector == "butd-r101":
            raise ValueError("--detector butd-r101 needs --detector-weights PATH (the converted Caffe "
                             "checkpoint, see docs/extract.md) or --detector-weights none (random)")
        w = "imagenet"
    if w == "imagenet" and detector == "butd-r101":
        raise ValueError("--detector butd-r101 has no downloadable weights: pass --detector-weights PATH "
                         "(the converted Caffe checkpoint, see docs/extract.md) or none")
    if w not in DETECTOR_WEIGHTS:
        if not Path(w).is_file():
            raise ValueError(f"--detector-weights {w!r}: not 'imagenet', 'none' or an existing checkpoint file")
        w = str(Path(w).resolve())
    return boxes, detector, w


def region_arrays(plan) -> dict:
    """The auxiliary per-row arrays of a regions set: boxes and count, and for butd-r101 each
    box's object label, attribute and their probabilities (padding rows are 0)."""
    k = plan.max_regions
    arrays = {"boxes": ((k, 4), "float32"), "count": ((), "int16")}
    if getattr(plan, "detector", None) == "butd-r101":
        arrays.update(labels=((k,), "int16"), label_scores=((k,), "float32"),
                      attrs=((k,), "int16"), attr_scores=((k,), "float32"))
    return arrays


def check_boxes(boxes: np.ndarray, width: int, height: int) -> np.ndarray:
    """Clip to the image; raise ValueError for a box with no area inside it."""
    b = boxes.copy()
    b[:, [0, 2]] = b[:, [0, 2]].clip(0, width)
    b[:, [1, 3]] = b[:, [1, 3]].clip(0, height)
    bad = np.flatnonzero((b[:, 2] <= b[:, 0]) | (b[:, 3] <= b[:, 1]))
    if len(bad):
        raise ValueError(f"box {int(bad[0])} {boxes[bad[0]].tolist()} has no area inside the "
                         f"{width}x{height} image")
    return b


def build_detector(plan, device):
    """torchvision's Faster R-CNN (ResNet-50 FPN) for ``--detector coco-frcnn``.

    ``plan.detector_weights``: ``imagenet`` = torchvision's COCO weights (its download cache),
    ``none`` = random from ``plan.seed``, or a local state dict of ``fasterrcnn_resnet50_fpn``.
    Never the backbone's ``--weights``, and never random unless ``none`` was asked.
    """
    import torch
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights, fasterrcnn_resnet50_fpn

    kw = dict(min_size=plan.crop_size, max_size=plan.crop_size, box_score_thresh=0.0,
              box_detections_per_img=max(plan.max_regions, 100))
    w = getattr(plan, "detector_weights", None)
    if w == "imagenet":
        try:
            model = fasterrcnn_resnet50_fpn(weights=FasterRCNN_ResNet50_FPN_Weights.COCO_V1, **kw)
        except Exception as exc:
            raise ValueError(f"cannot load torchvision's Faster R-CNN COCO weights ({type(exc).__name__}: "
                             f"{exc}); pass --detector-weights PATH to a saved state dict, "
                             f"--detector-weights none (random), or --boxes FILE") from exc
    elif w == "none" or w:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(plan.seed)
            model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, **kw)
        if w != "none":
            _load_frcnn(model, w)
    else:
        raise ValueError("coco-frcnn detector without weights setting; pass --detector-weights imagenet|none|PATH")
    return model.eval().to(device)


def _load_frcnn(model, path: str) -> None:
    from .backbones import load_failure, read_state

    state = read_state(path, "--detector-weights", "not a state dict of torchvision's fasterrcnn_resnet50_fpn")
    try:
        model.load_state_dict(state, strict=True)
    except Exception as exc:
        raise ValueError(f"--detector-weights {path}: not a state dict of torchvision's "
                         f"fasterrcnn_resnet50_fpn ({load_failure(exc)})") from None


def detect_boxes(detector, images, device, max_regions: int, min_regions: int) -> list[np.ndarray]:
    import torch

    with torch.inference_mode():
        outs = detector([im.to(device).float() / 255.0 for im in images])
    result = []
    for o in outs:
        scores = o["scores"].cpu().numpy()
        boxes = o["boxes"].cpu().numpy()
        order = np.argsort(-scores, kind="stable")
        keep = order[scores[order] >= SCORE_THRESHOLD][:max_regions]
        if len(keep) < min_regions:
            keep = order[:min(min_regions, max_regions)]
        result.append(boxes[keep].astype(np.float32))
    return result
