"""Region boxes for ``--kind regions``: from a JSON file of boxes per image id, or from a
torchvision Faster R-CNN (top ``max_regions`` by score with a floor of ``min_regions``, as the
bottom-up-attention features of 10-100 / 36 boxes per image used by SCAN, SGRAF and T-EMDE).
"""

from __future__ import annotations

import numpy as np

SCORE_THRESHOLD = 0.2


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
    """Faster R-CNN (ResNet-50 FPN): COCO weights for ``--weights imagenet``, else random from seed."""
    import torch
    from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights, fasterrcnn_resnet50_fpn

    kw = dict(min_size=plan.crop_size, max_size=plan.crop_size, box_score_thresh=0.0,
              box_detections_per_img=max(plan.max_regions, 100))
    if plan.weights == "imagenet":
        try:
            model = fasterrcnn_resnet50_fpn(weights=FasterRCNN_ResNet50_FPN_Weights.COCO_V1, **kw)
        except Exception as exc:
            raise ValueError(f"cannot load the Faster R-CNN COCO weights ({exc}); use --boxes FILE") from exc
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(plan.seed)
            model = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, **kw)
    return model.eval().to(device)


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
