"""Training on a GPU's terms, checked on the CPU (issue 30): ``--precision bf16`` (autocast forward,
loss and metrics in fp32), the loss kept on the device and read every ``LOG_EVERY`` steps, lengths
kept on the host, evaluation sub-blocks sized from the device's memory without per-group syncs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import vsekit.models.sgraf as sgraf_mod
import vsekit.train.trainer as trainer_mod
from vsekit.cli import main
from vsekit.models import create_model
from conftest import make_region_store
from vsekit.storage.store import FeatureStore
from vsekit.train import train

torch.set_num_threads(1)

N_TRAIN, N_VAL, PER_IMAGE, K, C = 64, 16, 2, 6, 16
SMALL = dict(embed_dim=16, word_dim=8, batch_size=16, model_args={"sim_dim": 8}, progress=False, lr=1e-3)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return make_region_store(tmp_path_factory.mktemp("precision") / "s.zarr", n_train=N_TRAIN, n_val=N_VAL,
                             per_image=PER_IMAGE, regions=K, channels=C)


def _losses(run):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()[1:]]


@pytest.mark.parametrize("model", ["sgr", "saf"])
def test_bf16_run_trains_and_its_loss_is_close_to_fp32(store_path, tmp_path, model):
    train(store_path, "regions", model, tmp_path / "fp32", epochs=3, **SMALL)
    args = ["train", "--store", store_path, "--features", "regions", "--model", model, "--out",
            str(tmp_path / "bf16"), "--epochs", "3", "--embed-dim", "16", "--word-dim", "8", "--batch-size",
            "16", "--model-arg", "sim_dim=8", "--lr", "1e-3", "--precision", "bf16", "--no-progress",
            "--device", "cpu"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["train"]["precision"] == "bf16"
    fp32, bf16 = _losses(tmp_path / "fp32"), _losses(tmp_path / "bf16")
    assert all(np.isfinite(bf16))
    assert bf16[-1] < bf16[0]                     # it learns
    np.testing.assert_allclose(bf16, fp32, rtol=0.03)
    # the weights differ from fp32's (bf16 did run), but not by much
    a = torch.load(tmp_path / "fp32" / "checkpoint_last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "bf16" / "checkpoint_last.pt", weights_only=True)["model"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert all(v.dtype == a[k].dtype for k, v in b.items())     # parameters stay fp32


def test_bf16_autocasts_the_forward_only(store_path, tmp_path, monkeypatch):
    seen = []
    score = sgraf_mod.SGRAF.score

    def spy(self, img, cap):
        out = score(self, img, cap)
        seen.append((self.training, torch.is_autocast_enabled("cpu"), out.dtype))
        return out

    monkeypatch.setattr(sgraf_mod.SGRAF, "score", spy)
    train(store_path, "regions", "sgr", tmp_path / "r", epochs=1, precision="bf16", **SMALL)
    training = [s for s in seen if s[0]]
    validation = [s for s in seen if not s[0]]
    assert training and all(s[1] and s[2] == torch.bfloat16 for s in training)
    assert validation and not any(s[1] for s in validation) and all(s[2] == torch.float32 for s in validation)


def test_precision_is_refused_unless_known(store_path, tmp_path):
    with pytest.raises(ValueError, match="--precision"):
        train(store_path, "regions", "sgr", tmp_path / "r", epochs=1, precision="fp16", **SMALL)


def test_the_loss_is_read_from_the_device_every_k_steps(store_path, tmp_path, monkeypatch):
    """No host read of the loss per step: one per epoch without a progress bar, and one every
    LOG_EVERY steps with it. Counted: every tensor's __float__ / item called from vsekit's own code
    (torch's CPU Adam reads its host-side step counters itself; those never wait on a device)."""
    import os
    import sys

    import vsekit

    # vsekit's own source files, by the package's location: a checkout's or venv's folder name
    # (a clone named "vsekit" holding .venv/.../torch/optim) must not decide what counts
    package_dir = os.path.dirname(os.path.abspath(vsekit.__file__)) + os.sep
    monkeypatch.setattr(trainer_mod, "validate", lambda *a, **k: {"rsum": 0.0})
    reads = []
    for name in ("__float__", "item"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            if os.path.abspath(sys._getframe(1).f_code.co_filename).startswith(package_dir):
                reads.append(1)
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    lengths = []
    encode = sgraf_mod.SGRAF.encode_captions
    monkeypatch.setattr(sgraf_mod.SGRAF, "encode_captions",
                        lambda self, t, n: lengths.append(n.device.type) or encode(self, t, n))
    steps = N_TRAIN * PER_IMAGE // SMALL["batch_size"]   # the SGRAF presets: every caption per epoch
    train(store_path, "regions", "saf", tmp_path / "a", epochs=2, **SMALL)
    assert len(reads) == 2
    assert set(lengths) == {"cpu"} and len(lengths) == 2 * steps
    reads.clear()
    monkeypatch.setattr(trainer_mod, "LOG_EVERY", 2)
    train(store_path, "regions", "saf", tmp_path / "b", epochs=2, **{**SMALL, "progress": True})
    assert len(reads) == 2 * (1 + steps // 2)


def test_block_budget_from_the_device_memory(monkeypatch):
    assert sgraf_mod.block_budget("cpu") == sgraf_mod.SCORE_BLOCK_ELEMENTS
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (32 << 30, 80 << 30))
    assert sgraf_mod.block_budget("cuda") == (32 << 30) // 32 // 4            # 2^28 elements
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 80 << 30))
    assert sgraf_mod.block_budget("cuda") == sgraf_mod.SCORE_BLOCK_ELEMENTS_ACCELERATOR   # the floor


@pytest.mark.usefixtures("float64")
def test_evaluation_reads_the_lengths_once(monkeypatch):
    """SGRAF evaluation groups captions on the host: no per-group int()/item() of device tensors."""
    torch.manual_seed(0)
    m = create_model("sgr", img_shape=(K, C), vocab_size=30, embed_dim=16, word_dim=5, sim_dim=8).eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 9, (100,), generator=g)
    tokens = torch.randint(1, 30, (100, 8), generator=g)
    with torch.no_grad():
        img = m.encode_images(torch.randn(7, K, C, generator=g))
        cap = m.encode_captions(tokens, lengths)
        ref = torch.cat([m.score(img, tuple(t[a:a + 1] for t in cap)) for a in range(100)], 1)
        calls = {"int": 0, "tolist": 0}
        for name, key in (("__int__", "int"), ("__index__", "int"), ("item", "int"), ("tolist", "tolist")):
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _k=key, **k: (
                calls.__setitem__(_k, calls[_k] + 1), _o(self, *a, **k))[1])
        out = m.score(img, cap)
    assert calls == {"int": 0, "tolist": 1}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)   # float64 (the fixture): no CPU's rounding
