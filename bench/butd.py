"""Benchmark: the BUTD detector (``--detector butd-r101``) against torchvision's
``fasterrcnn_resnet50_fpn`` on the same images in the same run, at batch 1.

- detector forward: BUTD = res4 + RPN + 300 RoIs × (RoIPool 14×14 → dilated res5) + heads on the
  Caffe scale (shorter side 600, longer <= 1000); torchvision = its own ``forward`` (transform to
  800/1333, ResNet-50 FPN, RPN, 1000 RoIs, box head, postprocess);
- selection: BUTD's generate_tsv.py selection (1,600 per-class NMS) on the forward's outputs;
- full path: ``vsekit extract --kind regions`` over a store of the same images (decode, detector,
  features, write): ``--detector butd-r101`` against ``--detector coco-frcnn`` (whose features
  come from a ResNet-152 by RoIAlign).

    .venv/bin/python bench/butd.py                      # 2 images of 480x640, 2 torch threads, CPU
    .venv/bin/python bench/butd.py --images 4 --device cuda

Random weights: speed does not depend on their values (the proposal counts are printed, since a
random RPN could propose fewer than 300 boxes). Writes a Markdown table to bench/results/butd.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# bench/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def _time(fn, items, device):
    import torch

    out, t0 = [], time.perf_counter()
    for it in items:
        out.append(fn(it))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return (time.perf_counter() - t0) / len(items), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "butd.md"))
    args = ap.parse_args()

    import numpy as np
    import torch
    from PIL import Image
    from torchvision.models.detection import fasterrcnn_resnet50_fpn

    from vsekit.extract import extract
    from vsekit.extract.extractor import cached_extractor
    from vsekit.extract.plan import make_plan
    from vsekit.extract import butd_select as sel
    from vsekit.extract.butd import ButdDetector
    from vsekit.storage import FeatureStore

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    imgs = [rng.integers(0, 256, (args.height, args.width, 3), dtype=np.uint8) for _ in range(args.images)]
    chw = [torch.from_numpy(a.transpose(2, 0, 1).copy()) for a in imgs]
    dev = args.device

    butd = ButdDetector("none", dev, min_boxes=10, max_boxes=100)
    frcnn = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).eval().to(dev)
    small = torch.zeros(3, 64, 64, dtype=torch.uint8)
    with torch.inference_mode():                              # warm-up on a tiny image (cheap)
        butd.forward(small)
        frcnn([small.to(dev).float() / 255])
    t_butd, outs = _time(butd.forward, chw, dev)
    with torch.inference_mode():
        t_tv, _ = _time(lambda x: frcnn([x.to(dev).float() / 255]), chw, dev)
    t_sel, kept = _time(lambda o: butd.select(*o), outs, dev)
    n_props = [int(o[0].shape[0]) for o in outs]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "img"
        root.mkdir()
        for k, a in enumerate(imgs):
            Image.fromarray(a).save(root / f"{k}.jpg", quality=90)
        store = FeatureStore.create(Path(tmp) / "s.zarr", dataset="bench", image_root=root)
        store.write_images([str(k) for k in range(len(imgs))], [f"{k}.jpg" for k in range(len(imgs))],
                           ["test"] * len(imgs))
        common = dict(workers=0, progress=False, device=dev, batch_size=1, block_rows=len(imgs))
        butd_kw = dict(detector="butd-r101", detector_weights="none", max_regions=100, min_regions=10)
        coco_kw = dict(weights="none", detector="coco-frcnn", detector_weights="none", max_regions=100,
                       min_regions=10)
        # the runner's per-process model cache is filled first, so model building is not timed
        cached_extractor(make_plan("vgg19", "regions", **butd_kw), dev)
        r_butd = extract(store, kind="regions", name="butd", **butd_kw, **common)
        plan = make_plan("resnet152", "regions", **coco_kw)
        cached_extractor(plan, dev).detect(torch.zeros(1, 1, 3, plan.crop_size, plan.crop_size, dtype=torch.uint8))
        r_coco = extract(store, "resnet152", "regions", name="coco", **coco_kw, **common)
    f_butd, f_coco = r_butd.seconds / r_butd.images, r_coco.seconds / r_coco.images

    rows = [("detector forward, batch 1", t_butd, t_tv),
            ("BUTD selection (1,600-class NMS)", t_sel, None),
            ("full path: vsekit extract --kind regions", f_butd, f_coco)]
    lines = [f"# BUTD detector vs torchvision fasterrcnn_resnet50_fpn ({args.images} images "
             f"{args.width}x{args.height}, {dev}, {args.threads} threads, random weights)", "",
             "| step | butd-r101 s/img | torchvision / coco-frcnn s/img | ratio (butd / torchvision) |",
             "| --- | ---: | ---: | ---: |"]
    for name, a, b in rows:
        lines.append(f"| {name} | {a:.2f} | {'' if b is None else f'{b:.2f}'} | "
                     f"{'' if b is None else f'{a / b:.2f}x'} |")
    lines += ["", f"BUTD proposals per image: {n_props} (RPN keeps at most {sel.RPN_POST_NMS}); "
              f"regions kept: {[len(r.boxes) for r in kept]}.",
              "Command: `python bench/butd.py " + " ".join(sys.argv[1:]) + "`"]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
