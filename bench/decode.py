"""Benchmark: the decoding worker's whole-process CPU per image, vsekit against a plain DataLoader (issue 37).

Whole processes (``bench/procs.py``): ``vsekit.extract.extract`` with ``--workers 1``, batch 32, a
near-free registered model, 640x480 JPEGs (quality 90), resize 256, crops of 224, for each
``--decoder``; and, in the same run, a plain torch ``DataLoader`` (1 worker, batch 32, dataset item
``decode_jpeg`` + ``transforms.v2`` resize + ``ten_crop`` / ``center_crop``, default collate).
Figure: the worker's CPU (``getrusage(RUSAGE_CHILDREN)`` of the extract process) per image in the
steady state, (240 images - 48 images) / 192; ratio = vsekit's worker / the plain DataLoader's
worker in the same round. Target (issues 37, 47): <= 1.1 for the default decoder (``torchvision``,
a full-size decode, the same work as the plain DataLoader's), at 10 and 1 crops.

    .venv/bin/python -P bench/decode.py                      # pil and torchvision, 10 and 1 crops, 3 rounds
    .venv/bin/python -P bench/decode.py --decoders pil --crops 10 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import procs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", nargs="+", default=["pil", "torchvision"],
                    choices=["pil", "torchvision", "turbo"])
    ap.add_argument("--crops", type=int, nargs="+", default=[10, 1], choices=[1, 10])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", default=None,
                    help="also run vsekit's legs with this src folder (e.g. a worktree of an older commit)")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)

    legs = {}
    for c in args.crops:
        legs[f"plain-{c}"] = {"leg": "plain", "crops": c}
        for d in args.decoders:
            legs[f"{d}-{c}"] = {"leg": "vsekit", "crops": c, "decoder": d, "channels_last": True}
            if args.baseline_src:
                legs[f"base-{d}-{c}"] = {"leg": "vsekit", "crops": c, "decoder": d, "channels_last": True,
                                         "src": args.baseline_src}
    before = procs.load()
    with tempfile.TemporaryDirectory() as tmp:
        res = procs.measure(legs, args.rounds, Path(tmp))
    after = procs.load()
    lines = [f"Command: `.venv/bin/python -P bench/decode.py --decoders {' '.join(args.decoders)} --crops "
             f"{' '.join(map(str, args.crops))} --rounds {args.rounds}`; {before} (start), {after} (end).", "",
             "Decoding worker's whole-process CPU per image (RUSAGE_CHILDREN), steady state ((240 - 48 images) "
             f"/ 192), median of {args.rounds} interleaved rounds; ratio = median of the per-round ratios to "
             "the plain DataLoader's worker.", "",
             "| worker | crops | ms/img (rounds) | ratio to plain |", "| --- | ---: | ---: | ---: |"]
    for c in args.crops:
        base = res[f"plain-{c}"]["worker_ms"]
        lines.append(f"| plain DataLoader (`decode_jpeg` + v2) | {c} | {procs.med(base):.2f} "
                     f"({', '.join(f'{x:.2f}' for x in base)}) | 1.00 |")
        for tag in (("base-", "") if args.baseline_src else ("",)):
            for d in args.decoders:
                w = res[f"{tag}{d}-{c}"]["worker_ms"]
                ratio = procs.med([a / b for a, b in zip(w, base)])
                who = "baseline" if tag else "vsekit"
                lines.append(f"| {who} `--decoder {d}` | {c} | {procs.med(w):.2f} ({', '.join(f'{x:.2f}' for x in w)}) "
                             f"| **{ratio:.2f}** |")
    text = "\n".join(lines)
    print(text)
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
