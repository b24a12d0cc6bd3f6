"""Benchmark: the driving process's own CPU per image during extraction, beyond the model (issue 37).

Whole processes (``bench/procs.py``): ``vsekit.extract.extract`` with a near-free registered model
(``bench_free``: one 1x1 convolution), ``--workers 1``, batch 32, 640x480 JPEGs, resize 256, crops
of 224, and, in the same run, a plain torch ``DataLoader`` (1 worker, batch 32, ``decode_jpeg`` +
``transforms.v2`` resize + ``ten_crop``, default collate). Steady state per image = (extract of 240
images - extract of 48) / 192, CPU from ``getrusage`` (the extract process as RUSAGE_SELF, its
decoding worker as RUSAGE_CHILDREN). Figure: vsekit's driving process less normalise + forward of
the same tensors outside vsekit (timed inside the plain leg, NCHW and channels-last, each matched to
the vsekit leg's ``--channels-last`` setting). Target (issue 37): <= 0.35 ms per image.

    .venv/bin/python -P bench/host.py                        # 10 and 1 crops, 3 rounds (~5 min on 2 busy cores)
    .venv/bin/python -P bench/host.py --crops 10 --rounds 1
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


def legs(crops: int, decoder: str, baseline: str | None) -> dict:
    out = {f"plain-{crops}": {"leg": "plain", "crops": crops}}
    for tag, src in (("", None), ("base-", baseline)):
        if tag and not src:
            continue
        for fmt in ("cl", "nchw"):
            out[f"{tag}vsekit-{decoder}-{fmt}-{crops}"] = {"leg": "vsekit", "crops": crops, "decoder": decoder,
                                                          "channels_last": fmt == "cl", "src": src}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--crops", type=int, nargs="+", default=[10, 1], choices=[1, 10])
    ap.add_argument("--decoder", default="pil")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-src", default=None,
                    help="also run vsekit's legs with this src folder (e.g. a worktree of an older commit)")
    ap.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = ap.parse_args(argv)

    all_legs = {}
    for c in args.crops:
        all_legs.update(legs(c, args.decoder, args.baseline_src))
    before = procs.load()
    with tempfile.TemporaryDirectory() as tmp:
        res = procs.measure(all_legs, args.rounds, Path(tmp))
    after = procs.load()
    m = {name: {k: procs.med(v) for k, v in figs.items()} for name, figs in res.items()}
    lines = [f"Command: `.venv/bin/python -P bench/host.py --crops {' '.join(map(str, args.crops))} "
             f"--decoder {args.decoder} --rounds {args.rounds}`; {before} (start), {after} (end).", "",
             "Whole-process CPU per image, steady state ((240 - 48 images) / 192), median of "
             f"{args.rounds} interleaved rounds; model = normalise + forward of the same tensors outside "
             "vsekit, in the leg's memory format, `(x.float() - mean) / std` as a plain loop writes it; "
             "in-place model = the same tensors normalised in place on NHWC rows (what vsekit does since "
             "issue 37), channels-last.", "",
             "| leg | crops | driving process ms/img | model ms/img | driving beyond model | beyond the in-place model | "
             "its worker ms/img |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in args.crops:
        plain = m[f"plain-{c}"]
        lines.append(f"| plain DataLoader (NCHW) | {c} | {plain['driving_ms']:.2f} | {plain['model_nchw_ms']:.2f} | "
                     f"{plain['driving_beyond_ms']:.2f} | | {plain['worker_ms']:.2f} |")
        for tag in (("base-", "") if args.baseline_src else ("",)):
            for fmt, key in (("cl", "model_channels_last_ms"), ("nchw", "model_nchw_ms")):
                name = f"{tag}vsekit-{args.decoder}-{fmt}-{c}"
                v = m[name]
                model = procs.med(res[f"plain-{c}"][key])
                beyond = [d - mo for d, mo in zip(res[name]["driving_ms"], res[f"plain-{c}"][key])]
                inplace = "" if fmt != "cl" else "%.2f" % procs.med(
                    [d - mo for d, mo in zip(res[name]["driving_ms"], res[f"plain-{c}"]["model_channels_last_inplace_ms"])])
                flag = "--channels-last" if fmt == "cl" else "--no-channels-last"
                who = "baseline" if tag else "vsekit"
                lines.append(f"| {who} `--decoder {args.decoder}` {flag} | {c} | {v['driving_ms']:.2f} | {model:.2f} | "
                             f"**{procs.med(beyond):.2f}** | {inplace} | {v['worker_ms']:.2f} |")
    text = "\n".join(lines)
    print(text)
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
