"""Benchmark ``vsekit report`` on a COCO-5K-sized test split against rendering everything.

Builds a store whose test split has COCO-5K's size (default 5,000 images × 5 = 25,000 captions,
random 1,024-d global features, random 12-token captions; the JPEGs are 16 demo images reused) and a
run folder with an untrained ``vse`` model (GRU text encoder). Then, each in a fresh subprocess
(wall time and peak RSS):

- ``report``: ``vsekit.report.report`` with its defaults (8 caption and 6 image queries, scored in
  blocks of 256 against the other side, thumbnails of the shown images only);
- ``report-sims``: the same with a saved ``sims_test.npy`` (what ``vsekit evaluate`` writes), read
  through a memory map;
- ``baseline``: what a report that renders everything costs: encode every image and caption, the full
  5,000 × 25,000 similarity matrix, a full argsort of every caption's column and every image's row.

    .venv/bin/python bench/report.py                # COCO-5K size (default)
    .venv/bin/python bench/report.py --images 1000  # quick
"""

from __future__ import annotations

import os
import sys

# bench/ holds tokenize.py, which would shadow Python's own module when bench/ is first on sys.path
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse
import json
import platform
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def build(tmp: Path, n_images: int, per_image: int, dim: int, seed: int = 0) -> tuple[Path, Path]:
    """A store whose images are all in the test split, and a run folder over it."""
    import torch

    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.store import FeatureStore, write_array
    from vsekit.models import create_model

    rng = np.random.default_rng(seed)
    make_demo_data(tmp / "demo", images=16, seed=seed, size=128)
    store = FeatureStore.create(tmp / "bench.zarr", dataset="bench", image_root=tmp / "demo")
    store.write_images([str(i) for i in range(n_images)],
                       [f"images/demo_{i % 16:06d}.jpg" for i in range(n_images)], ["test"] * n_images)
    n_caps = n_images * per_image
    store.write_captions([f"caption {j}" for j in range(n_caps)], np.repeat(np.arange(n_images), per_image))
    vocab = ["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(996)]
    ids = rng.integers(4, len(vocab), size=n_caps * 12).astype(np.int32)
    g = store.root.require_group("tokens")
    write_array(g, "ids", ids)
    write_array(g, "offsets", np.arange(0, n_caps * 12 + 1, 12, dtype=np.int64))
    g.attrs["vocabulary"] = vocab
    fs = store.create_features("feats", (dim,), "float32", attrs={"kind": "global", "model": "random"})
    for b in fs.blocks():
        fs.write_block(b, rng.normal(size=(len(b), dim)).astype(np.float32))
    run = tmp / "run"
    run.mkdir()
    kwargs = {"img_shape": [dim], "vocab_size": len(vocab), "embed_dim": 512, "word_dim": 128}
    torch.manual_seed(0)
    model = create_model("vse", **kwargs)
    torch.save({"model": model.state_dict()}, run / "checkpoint_best.pt")
    (run / "config.json").write_text(json.dumps({"model": "vse", "model_kwargs": kwargs,
                                                 "store": str(store.path), "features": "feats"}))
    (run / "metrics.json").write_text(json.dumps({"protocols": {"coco-5k": {"i2t_r1": 0.0, "rsum": 0.0}}}))
    return store.path, run


def child(mode: str, store: str, run: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if mode in ("report", "report-sims"):
        from vsekit.report import report

        s = report([run], out)
        extra = {"caption_examples": s.n_caption_examples, "image_examples": s.n_image_examples}
    else:
        from vsekit.report.model_io import ModelSource, SplitData, load_model
        from vsekit.report.runs import load_run
        from vsekit.storage.store import FeatureStore

        info = load_run(run)
        data = SplitData.of(FeatureStore.open(store), "test", "feats")
        src = ModelSource(load_model(info), data, "feats", block=256)
        everything = np.arange(src.n_images)
        with torch.no_grad():
            img = src.encode_images(everything)
            cap = torch.cat([src.encode_captions(np.arange(s, min(s + 1024, src.n_captions)))
                             for s in range(0, src.n_captions, 1024)])
            sims = src.model.score(img, cap).numpy()
        top_caps = np.argsort(-sims, axis=1, kind="stable")[:, :5]
        top_imgs = np.argsort(-sims.T, axis=1, kind="stable")[:, :5]
        extra = {"caption_examples": int(len(top_imgs)), "image_examples": int(len(top_caps))}
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if mode == "baseline":  # after measuring: the saved matrix `vsekit evaluate` would write
        np.save(Path(run) / "sims_test.npy", sims.astype(np.float32))
    print(json.dumps({"mode": mode, "seconds": seconds, "peak_mib": peak, **extra}))


def measure(mode: str, store: Path, run: Path, out: Path) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", mode, str(store), str(run), str(out)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=5000, help="test images (COCO-5K: 5000)")
    ap.add_argument("--per-image", type=int, default=5, help="captions per image")
    ap.add_argument("--dim", type=int, default=1024, help="feature width")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "report.md"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        store, run = build(tmp, args.images, args.per_image, args.dim)
        rows = [measure("report", store, run, tmp / "o1"), measure("baseline", store, run, tmp / "o0")]
        rows.append(measure("report-sims", store, run, tmp / "o3"))  # the baseline saved sims_test.npy
        rows = [rows[1], rows[0], rows[2]]
    base = rows[0]
    lines = [f"# vsekit report — {args.images:,} test images × {args.per_image} captions, {args.dim}-d features",
             "", f"`.venv/bin/python bench/report.py --images {args.images} --per-image {args.per_image} "
                 f"--dim {args.dim}` · {platform.machine()}, 1 torch thread per process, on a CPU machine "
                 f"shared with other engineers' test runs (seconds vary a lot with the load; compare the ratios)", "",
             "| mode | seconds | peak RSS (MiB) | speed-up vs baseline | memory vs baseline |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['seconds']:.1f} | {r['peak_mib']:.0f} | "
                     f"{base['seconds'] / r['seconds']:.1f}× | {r['peak_mib'] / base['peak_mib']:.2f}× |")
    lines += ["", "baseline: every image and caption encoded, the full similarity matrix, a full argsort per "
              "query (what rendering every query would need); report: 8 caption + 6 image queries scored "
              "in blocks of 256 (the default), page written; report-sims: the same from a saved "
              "`sims_test.npy` (memory-mapped; its peak RSS counts the mapped pages of the 500 MB file it "
              "reads 8 columns from). Both report modes also load the model and draw 3 attention maps."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
