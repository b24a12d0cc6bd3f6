"""One module saves and loads checkpoints and knows the run folder: ``vsekit.train.checkpoint``.

Every reader of a checkpoint (train's resume, ``evaluate``, ``embed``, ``report``) goes through its
``load_file``, so a hostile or damaged file is refused the same way wherever it is read.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vsekit.storage.store import StoreError
from vsekit.train import checkpoint


def _run(tmp_path, *, trainer: bool = True, which: str = "best"):
    """A run folder with a VSE++ model's checkpoint, as the trainer (or another tool) writes it."""
    kw = {"img_shape": [6], "vocab_size": 11, "embed_dim": 4, "word_dim": 3}
    torch.manual_seed(0)
    from vsekit.models import create_model

    model = create_model("vse", **{**kw, "img_shape": (6,)})
    run = tmp_path / "run"
    run.mkdir()
    if trainer:
        config = {"train": {"model": "vse"}, "model_kwargs": kw, "store": "s.zarr", "features": "f"}
    else:
        config = {"model": "vse", "model_kwargs": {**kw, "img_shape": (6,)}}
    (run / "config.json").write_text(json.dumps(config))
    checkpoint.save_checkpoint(run / f"checkpoint_{which}.pt",
                               {"model": model.state_dict(), "epoch": np.int64(3), "shape": (1, 2)})
    return run, model


def test_save_is_plain_data_and_atomic(tmp_path):
    run, model = _run(tmp_path)
    path = run / "checkpoint_best.pt"
    assert not list(run.glob("*.tmp"))
    raw = torch.load(path, weights_only=True)   # plain data: loads without trusting the file
    assert raw["epoch"] == 3 and isinstance(raw["epoch"], int) and raw["shape"] == [1, 2]
    ck = checkpoint.load_checkpoint(path)
    for k, v in model.state_dict().items():
        assert torch.equal(ck["model"][k], v)


def test_run_checkpoint_prefers_the_asked_one_then_the_last(tmp_path):
    run, _ = _run(tmp_path, which="last")
    assert checkpoint.run_checkpoint(run) == run / "checkpoint_last.pt"
    checkpoint.save_checkpoint(run / "checkpoint_best.pt", {"model": {}})
    assert checkpoint.run_checkpoint(run) == run / "checkpoint_best.pt"
    assert checkpoint.run_checkpoint(run, "last") == run / "checkpoint_last.pt"
    assert checkpoint.run_checkpoint(tmp_path) is None


def test_load_model_rebuilds_the_trained_weights(tmp_path):
    run, model = _run(tmp_path)
    loaded, config = checkpoint.load_model(run)
    assert config["checkpoint"] == str(run / "checkpoint_best.pt") and config["checkpoint_epoch"] == 3
    x = torch.randn(5, 6)
    assert torch.equal(loaded.encode_images(x), model.eval().encode_images(x))
    with pytest.raises(StoreError, match="not a training run folder"):
        checkpoint.load_model(tmp_path)


@pytest.mark.parametrize("trainer", [True, False])
def test_every_reader_loads_through_the_one_loader(tmp_path, monkeypatch, trainer):
    """The report's loader, for the trainer's runs and for other tools' runs, reads the file with
    ``checkpoint.load_file``; a damaged file gives the same refusal."""
    from vsekit.report import model_io
    from vsekit.report.runs import load_run

    run, model = _run(tmp_path, trainer=trainer)
    calls = []
    real = checkpoint.load_file
    monkeypatch.setattr(checkpoint, "load_file", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    loaded = model_io.load_model(load_run(run))
    assert calls == [run / "checkpoint_best.pt"]
    x = torch.randn(2, 6)
    assert torch.equal(loaded.encode_images(x), model.eval().encode_images(x))
    data = (run / "checkpoint_best.pt").read_bytes()
    (run / "checkpoint_best.pt").write_bytes(data[: len(data) // 2])   # truncated
    with pytest.raises(StoreError, match="not a readable checkpoint"):
        model_io.load_model(load_run(run))
