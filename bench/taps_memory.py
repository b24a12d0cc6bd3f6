"""Peak host memory of pooling one half-precision FNE tap: ``out.float().mean()`` (before issue 30)
against ``taps.spatial_mean`` (float32 accumulation a batch chunk at a time), each in a fresh
subprocess, peak RSS above the RSS once the map exists (Linux: the high-water mark VmHWM, reset
through /proc/self/clear_refs after the map is made; elsewhere ``ru_maxrss``).

    .venv/bin/python -P bench/taps_memory.py                      # conv1 of VGG at 224, 4 images x 10 crops
    .venv/bin/python -P bench/taps_memory.py --batch 32 --crops 10   # the issue's case (needs ~6 GB)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, torch
torch.set_num_threads(1)
from vsekit.extract import taps
n, c, s, dtype, method, cl, chunk = json.loads(sys.argv[1])
if chunk:
    taps.POOL_CHUNK_BYTES = chunk
fmt = torch.channels_last if cl else torch.contiguous_format
x = torch.empty(n, c, s, s, dtype=getattr(torch, dtype), memory_format=fmt)
for i in range(n):   # row by row: no float32 temporary of the whole map raises the baseline peak
    x[i].normal_()
taps.spatial_mean(torch.ones(2, c, 4, 4).to(x.dtype).contiguous(memory_format=fmt))   # warm-up: first-call allocations
x[:1].float().mean(dim=(2, 3))
def status_kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None
try:   # Linux: reset the high-water mark, so that what the imports once took cannot hide the peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    hwm = status_kb("VmHWM")
except OSError:
    hwm = None
if hwm is not None:
    base = now = status_kb("VmRSS")
else:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    import psutil
    now = psutil.Process().memory_info().rss // 1024
if method == "copy":
    y = x.float().mean(dim=(2, 3))
else:
    y = taps.spatial_mean(x)
peak = status_kb("VmHWM") if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"map_mib": x.numel() * x.element_size() / 2**20, "peak_above_mib": (peak - max(base, now)) / 1024,
                  "sum": float(y.double().sum())}))
"""


def peak_above(n: int, c: int, side: int, dtype: str = "bfloat16", method: str = "chunked",
               channels_last: bool = False, chunk: int | None = None) -> dict:
    """Run one pooling in a fresh process; its peak RSS above the RSS with the map allocated (MiB)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([n, c, side, dtype, method, channels_last, chunk])],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="images per batch")
    ap.add_argument("--crops", type=int, default=10)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--side", type=int, default=224)
    args = ap.parse_args(argv)
    n = args.batch * args.crops
    rows = []
    for cl in (False, True):
        for method in ("copy", "chunked"):
            r = peak_above(n, args.channels, args.side, "bfloat16", method, cl)
            rows.append({"layout": "channels_last" if cl else "contiguous", "method": method, **r})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nbf16 map {n}x{args.channels}x{args.side}x{args.side} ({rows[0]['map_mib']:.0f} MiB); "
          f"peak RSS above the map while pooling:")
    for r in rows:
        print(f"| {r['layout']} | {r['method']} | {r['peak_above_mib']:.0f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
