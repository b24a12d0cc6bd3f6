#!/usr/bin/env bash
# Build the folder of wheels that `scripts/gpu_check.py --wheels DIR` (and `make gpu-check WHEELS=DIR`)
# installs on a GPU machine that cannot reach a package index.
#
#   scripts/build_wheels.sh [OUT_DIR] [--list]     # default OUT_DIR: .whl (ignored by git)
#
# Run it where pip can reach PyPI, inside the environment vsekit is tested in (.venv): it takes every
# distribution vsekit needs (its dependencies and the `slurm` and `bench` extras, recursively) at the
# version installed HERE, leaves out what the GPU image already has (torch, torchvision, timm, numpy,
# pillow, ... : IMAGE_HAS below, from /work/.library/device/KINDS.md), downloads the rest as wheels for
# the GPU machine (CPython $PYVER, manylinux x86_64; --no-deps, so exactly that list), and builds
# vsekit's own wheel. --list prints the list and downloads nothing.
set -euo pipefail
OUT=${1:-.whl}
LIST_ONLY=0
[[ "${2:-}" == "--list" || "${1:-}" == "--list" ]] && LIST_ONLY=1
[[ "$OUT" == "--list" ]] && OUT=.whl
PY=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
PYVER=${PYVER:-3.12}
IMAGE_HAS="torch torchvision torchaudio triton timm numpy pillow h5py click pyyaml tqdm matplotlib psutil
  pytest hypothesis pytest-timeout numba llvmlite pyarrow tensorboard cloudpickle fsspec toolz msgpack
  sortedcontainers packaging jinja2 markupsafe regex joblib typing-extensions filelock networkx sympy mpmath
  setuptools six python-dateutil urllib3 certifi idna requests charset-normalizer contourpy cycler fonttools
  kiwisolver pyparsing safetensors huggingface-hub hf-xet pluggy iniconfig attrs protobuf grpcio absl-py
  markdown werkzeug tensorboard-data-server pandas pytz tzdata pyyaml"

LIST=$("$PY" - "$IMAGE_HAS" <<'PY'
import re, sys
from importlib.metadata import PackageNotFoundError, distribution
have = {n.lower().replace("_", "-") for n in sys.argv[1].split()}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
todo, seen, out = [("vsekit", {"slurm", "bench"})], set(), []
while todo:
    name, extras = todo.pop()
    if norm(name) in seen:
        continue
    seen.add(norm(name))
    if norm(name) in have or norm(name).startswith(("nvidia-", "cuda-")):
        continue   # the image has it, with its own dependencies
    try:
        d = distribution(name)
    except PackageNotFoundError:
        continue
    if norm(name) != "vsekit":
        out.append(f"{d.metadata['Name']}=={d.version}")
    for req in d.requires or []:
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?", req)
        marker = req.split(";", 1)[1] if ";" in req else ""
        want = re.findall(r"extra\s*==\s*['\"]([^'\"]+)", marker)
        if want and not set(want) & extras:
            continue
        if "python_version" in marker or "sys_platform" in marker or "platform_" in marker:
            try:
                from packaging.markers import Marker
                env = {"python_version": "3.12", "sys_platform": "linux", "platform_system": "Linux",
                       "platform_machine": "x86_64", "extra": next(iter(extras), "")}
                if not Marker(marker).evaluate(env):
                    continue
            except Exception:
                pass
        sub = set(m.group(2)[1:-1].split(",")) if m.group(2) else set()
        todo.append((m.group(1), sub))
print("\n".join(sorted(out)))
PY
)
echo "$LIST"
[[ $LIST_ONLY == 1 ]] && exit 0
mkdir -p "$OUT"
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLAT[@]}" -d "$OUT" $LIST
"$PY" -m pip wheel -q --no-deps -w "$OUT" "$(dirname "$0")/.."
ls -la "$OUT"
du -sh "$OUT"
