"""Validation scores with the whole model in eval mode and leaves the model as it found it (issue 31).

SAF's ``saf_bn`` in training mode normalises with batch statistics and moves its running estimates:
validating in training mode would score with other statistics than ``vsekit evaluate`` uses and
leave validation data in the checkpoint's buffers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_region_store
from vsekit.storage.store import FeatureStore
from vsekit.train import train
from vsekit.train.config import resolve_config
from vsekit.train.data import EvalSet, Tokens, open_features
from vsekit.train.evaluate_run import evaluate
from vsekit.train.trainer import build_model, validate

torch.set_num_threads(1)

N_TRAIN, N_VAL, PER_IMAGE, K, C = 48, 24, 3, 6, 16
SMALL = dict(embed_dim=16, word_dim=8, batch_size=16, model_args={"sim_dim": 8}, progress=False)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return make_region_store(tmp_path_factory.mktemp("valmode") / "s.zarr", n_train=N_TRAIN, n_val=N_VAL,
                             per_image=PER_IMAGE, regions=K, channels=C)


def _setup(store_path, model="saf"):
    store = FeatureStore.open(store_path)
    cfg = resolve_config(model, (), **{k: v for k, v in SMALL.items() if k != "progress"})
    source = open_features(store, "regions", store.split_rows("val"))
    evalset = EvalSet.from_store(store, "val", source)
    tokens = Tokens.from_store(store)
    net, _ = build_model(cfg, source.row_shape, tokens.vocab_size)
    return net, source, tokens, evalset, cfg


@pytest.mark.parametrize("model", ["saf", "sgr"])
def test_validation_changes_no_parameter_buffer_or_mode(store_path, model):
    net, source, tokens, evalset, cfg = _setup(store_path, model)
    net.train()
    net.eval_w.eval()        # a mixed state must come back as it was, module by module
    modes = {name: m.training for name, m in net.named_modules()}
    before = {k: v.clone() for k, v in net.state_dict().items()}
    metrics = validate(net, source, tokens, evalset, cfg)
    after = net.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)
    assert {name: m.training for name, m in net.named_modules()} == modes
    # the same figure as the model put in eval mode by hand
    net.eval()
    assert validate(net, source, tokens, evalset, cfg)["rsum"] == metrics["rsum"]


def test_scoring_sees_the_model_in_eval_mode(store_path, monkeypatch):
    net, source, tokens, evalset, cfg = _setup(store_path)
    seen = []
    score = type(net).score

    def spy(self, img, cap):
        seen.append([m.training for m in self.modules()])
        return score(self, img, cap)

    monkeypatch.setattr(type(net), "score", spy)
    net.train()
    validate(net, source, tokens, evalset, cfg)
    assert seen and not any(any(flags) for flags in seen)
    assert net.training and net.saf_bn.training


def test_checkpoint_validation_rsum_equals_evaluate(store_path, tmp_path):
    run = tmp_path / "run"
    train(store_path, "regions", "saf", run, epochs=1, **SMALL)
    log = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    res = evaluate([run], split="val", protocols=["all"], checkpoint="last", progress=False, save=False)
    assert res["protocols"]["all"]["rsum"] == pytest.approx(log[-1]["val"]["rsum"], abs=1e-9)
    # the checkpoint's running estimates moved in training, not in validation
    ck = torch.load(run / "checkpoint_last.pt", weights_only=True)
    assert float(ck["model"]["saf_bn.running_mean"][0]) != 0.0
