"""`vsekit train` data-parallel through the CLI, and mid-epoch checkpoints that survive interruption.

- ``--nproc-per-node 2`` (torch's elastic launcher, gloo ranks on the CPU) trains the weights and logs
  the metrics of one process at the same global batch (float32, a few epochs: equal to tolerance);
- a rank count that does not divide ``--batch-size`` is refused with one Error line;
- ``--checkpoint-every N`` steps writes mid-epoch checkpoints; a run cut after one resumes with
  ``--resume`` to the weights and log of an uninterrupted run; Ctrl-C stops at the next step boundary,
  saves there and exits 130.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from vsekit.cli import main

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    """60 synthetic images with tokens and pixel features (36 train, 12 val, 12 test)."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.tokenize import tokenize
    from vsekit.train.demo import pixel_features

    d = tmp_path_factory.mktemp("ddp")
    make_demo_data(d, images=60, seed=3, size=16, val_fraction=0.2, test_fraction=0.2)
    store, _ = ingest_karpathy(d / "dataset_demo.json", d, d / "s.zarr")
    tokenize(store, min_count=1)
    pixel_features(store, block_rows=16)
    return str(d / "s.zarr")


def base(store_path, out, *extra, epochs=3, batch=8):
    return ["train", "--store", store_path, "--features", "pixels", "--model", "vse", "--out", str(out),
            "--preset", "demo", "--embed-dim", "16", "--word-dim", "8", "--batch-size", str(batch),
            "--epochs", str(epochs), "--captions", "all", "--no-progress", "--device", "cpu", *extra]


def cli(args, env_extra=None, timeout=300):
    """``vsekit`` in a fresh process (ranks need their own processes)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "vsekit.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def ok(args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    return res


def log(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def weights(path):
    return torch.load(path, weights_only=True, map_location="cpu")["model"]


def assert_same_weights(a, b, rtol=1e-4, atol=1e-5):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=rtol, atol=atol), (k, (wa[k] - wb[k]).abs().max().item())


@pytest.fixture(scope="module")
def single(store_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    ok(base(store_path, out))
    return out


def test_two_ranks_train_the_one_process_model(store_path, single, tmp_path):
    out = tmp_path / "ddp"
    res = cli(base(store_path, out, "--nproc-per-node", "2"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "data-parallel over 2 ranks (gloo)" in res.stdout
    assert res.stdout.count("trained vse for 3 epochs") == 1      # rank 0 reports, once
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt")
    one, two = log(single), log(out)
    assert [e["epoch"] for e in two] == [0, 1, 2, 3]
    for a, b in zip(one, two):
        assert (a["loss"] is None) == (b["loss"] is None)
        if a["loss"] is not None:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        for k in a["val"]:
            assert b["val"][k] == pytest.approx(a["val"][k], abs=1e-3), (a["epoch"], k)
    assert json.loads((out / "config.json").read_text())["train"]["batch_size"] == 8   # the global batch


def test_rank_count_not_dividing_the_batch_is_refused(store_path, tmp_path):
    res = cli(base(store_path, tmp_path / "r", "--nproc-per-node", "3"))
    assert res.returncode == 1
    errors = [x for x in (res.stdout + res.stderr).splitlines() if x.startswith("Error")]
    assert len(errors) == 1 and "--batch-size 8 is not a multiple of --nproc-per-node 3" in errors[0], errors
    assert not (tmp_path / "r").exists()


def test_mid_epoch_checkpoint_resumes_to_the_uninterrupted_run(store_path, single, tmp_path, monkeypatch):
    """A crash (a hard stop, nothing saved at that moment) in epoch 2: --resume from the checkpoint of
    --checkpoint-every 2 replays the rest of the epoch and ends with the uninterrupted weights and log."""
    from vsekit.train import trainer

    out = tmp_path / "cut"
    real = trainer.train_step
    calls = {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 27:         # 180 pairs in batches of 8: 23 steps an epoch; this is epoch 2's 4th
            raise MemoryError("the node went down")
        return real(*a, **k)

    monkeypatch.setattr(trainer, "train_step", crash)
    res = CliRunner().invoke(main, base(store_path, out, "--checkpoint-every", "2"))
    assert isinstance(res.exception, MemoryError), res.output
    ck = torch.load(out / "checkpoint_last.pt", weights_only=True)
    assert (ck["position"]["epoch"], ck["position"]["batches"]) == (2, 3)    # global step 26
    monkeypatch.setattr(trainer, "train_step", real)
    res = ok(base(store_path, out, "--checkpoint-every", "5", "--resume"))     # may change on resume
    assert f"resuming {out} epoch 2 after batch {ck['position']['batches']}" in res.output
    assert json.loads((out / "config.json").read_text())["resumed"] == [{"changed": {"checkpoint_every": ["2", "5"]}}]
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt", rtol=0, atol=0)
    strip = lambda es: [{k: v for k, v in e.items() if k != "time_s"} for e in es]  # noqa: E731
    assert strip(log(out)) == strip(log(single))


def test_ctrl_c_stops_at_a_step_boundary_and_saves(store_path, single, tmp_path, monkeypatch):
    """SIGINT in the middle of a step: the step finishes, the position after it is saved, exit 130;
    --resume ends with the uninterrupted weights."""
    from vsekit.train import trainer

    out = tmp_path / "int"
    real = trainer.train_step
    calls = {"n": 0}

    def interrupt(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:
            os.kill(os.getpid(), signal.SIGINT)     # arrives inside the step
        return real(*a, **k)

    monkeypatch.setattr(trainer, "train_step", interrupt)
    res = CliRunner().invoke(main, base(store_path, out))
    assert res.exit_code == 130, res.output
    ck = torch.load(out / "checkpoint_last.pt", weights_only=True)
    assert (ck["position"]["epoch"], ck["position"]["batches"]) == (1, 7)
    assert "interrupted in epoch 1 after batch 7" in res.output
    assert not list(out.glob("*.tmp"))
    monkeypatch.setattr(trainer, "train_step", real)
    ok(base(store_path, out, "--resume"))
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt", rtol=0, atol=0)


def test_checkpoint_every_minutes_on_rank_0s_clock(store_path, single, tmp_path, monkeypatch):
    """``--checkpoint-every 1m``: a mid-epoch checkpoint whenever a minute has passed since the last
    save (a clock that advances 10 s per reading here); a crash after one resumes to the
    uninterrupted weights. A malformed value is one Error line."""
    import time as real_time
    import types

    from vsekit.train import trainer

    clock = {"t": 0.0}

    def monotonic():
        clock["t"] += 10.0
        return clock["t"]

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=real_time.perf_counter,
                                                                monotonic=monotonic))
    real, calls = trainer.train_step, {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 30:
            raise MemoryError("the node went down")
        return real(*a, **k)

    monkeypatch.setattr(trainer, "train_step", crash)
    out = tmp_path / "minutes"
    res = CliRunner().invoke(main, base(store_path, out, "--checkpoint-every", "1m"))
    assert isinstance(res.exception, MemoryError), res.output
    ck = torch.load(out / "checkpoint_last.pt", weights_only=True)
    assert ck["position"]["epoch"] == 2 and 0 < ck["position"]["batches"] < 7
    monkeypatch.setattr(trainer, "train_step", real)
    ok(base(store_path, out, "--checkpoint-every", "1m", "--resume"))
    assert_same_weights(out / "checkpoint_last.pt", single / "checkpoint_last.pt", rtol=0, atol=0)
    res = CliRunner().invoke(main, base(store_path, tmp_path / "bad", "--checkpoint-every", "5x"))
    assert res.exit_code == 1
    assert [x for x in res.output.splitlines() if x.startswith("Error")] == [
        "Error: --checkpoint-every '5x': give a number of steps (e.g. 500) or of minutes (e.g. 20m)"]
