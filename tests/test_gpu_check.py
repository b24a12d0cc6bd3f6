"""`make gpu-check` in its CPU mode (issues 30, 47): every check runs with device=cpu on tiny sizes, so
the script that a GPU machine runs once cannot rot. The CUDA-vs-CPU comparisons become CPU-vs-CPU,
and ``--decoder nvjpeg``'s batched decode runs on the CPU, where it must equal the CPU decoder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"

# gpu-check's CPU mode runs every check in a subprocess (a minute): the slow set
pytestmark = pytest.mark.slow


def _run(tmp_path, *args, timeout=600):
    out = tmp_path / "gc.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--small", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    recs = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return r, {x["check"]: x for x in recs}


def test_cpu_mode_runs_every_fast_check_and_records_each_figure(tmp_path):
    r, recs = _run(tmp_path, "--skip", "cluster")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert recs["probe"]["ok"] and recs["probe"]["nms_equal"] and recs["probe"]["decode_jpeg_equals_pil"]
    assert recs["install"]["ok"] is None and "--wheels" in recs["install"]["why"]
    demo = recs["demo"]
    assert demo["ok"] and demo["global_float32_rel_err"] == 0.0 and demo["fne_float16_rel_err"] == 0.0
    assert demo["train_loss_rel_diff"] == 0.0
    for prec in ("fp32", "bf16"):
        for dec in ("torchvision", "nvjpeg"):   # warm-up and steady state apart: 4 images each of the 8
            t = recs[f"throughput.{prec}.{dec}"]
            assert t["ok"] and t["floor_img_s"] > 0 and t["e2e_img_s"] > 0 and t["peak_host_rss_mib"] > 0, t
            assert t["warmup_images"] == 4 and t["steady_images"] == 4 and t["steady_img_s"] > 0, t
        # nvjpeg's batched path, on the CPU here: the CPU decoder's features exactly
        assert recs[f"throughput.{prec}.nvjpeg"]["nvjpeg_rel_max"] == 0.0
    assert not any(k.startswith("throughput.fp16") for k in recs)   # CUDA only
    for leg in ("saf.fp32", "sgr.fp32", "vse.fp32", "vse.bf16"):   # against the references' formulation
        tc = recs[f"train_compare.{leg}"]
        ref, ours = tc[f"reference-{leg.split('.')[0]}"], tc[leg.split(".")[0]]
        assert tc["ok"] and tc["speedup"] > 0 and 0 < ours["matmul_floor_share"] and ours["loss"] > 0, tc
        if leg.startswith("vse"):   # the same products in both formulations (fc, GRU, scores), as the profiler counts
            assert abs(ref["matmul_gflop"] - ours["matmul_gflop"]) <= 0.01 * ref["matmul_gflop"], tc
    tp = recs["train_precision"]   # vsekit train --precision bf16 against fp32: loss within 3%
    assert tp["ok"] and tp["loss_rel_diff"] < 0.03 and tp["speedup"] > 0
    assert recs["detectors"]["ok"] is None        # minutes on a CPU: skipped in this mode, with the reason
    assert recs["sgraf"]["ok"] and recs["sgraf"]["sims_rel_err"] == 0.0
    assert recs["train_step"]["ok"] in (None, True)
    ddp = recs["ddp"]      # --nproc-per-node 1 through gloo against one process
    assert ddp["ok"] and ddp["backend"] == "gloo" and ddp["loss_rel_diff"] < 1e-4, ddp
    assert recs["done"]["ok"] and recs["done"]["failed"] == 0
    assert "cluster" not in recs


def test_a_failing_check_is_recorded_and_the_exit_status_is_1(tmp_path, monkeypatch):
    bad = tmp_path / "wheels"
    bad.mkdir()
    (bad / "broken-0.0-py3-none-any.whl").write_bytes(b"not a wheel")
    r, recs = _run(tmp_path, "--only", "install", "--wheels", str(bad))
    assert r.returncode == 1
    assert recs["install"]["ok"] is False and recs["done"]["failed"] == 1


def test_unknown_check_and_no_cuda_are_one_error_line(tmp_path):
    r, _ = _run(tmp_path, "--only", "nope")
    assert r.returncode == 1 and "Error: --only/--skip 'nope'" in r.stderr
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.jsonl")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Error: no CUDA device here" in r.stderr


def test_cpu_mode_cluster_check(tmp_path):
    r, recs = _run(tmp_path, "--only", "cluster")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert recs["cluster"]["ok"] and recs["cluster"]["done"] == 24
