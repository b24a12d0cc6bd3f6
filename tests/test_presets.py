"""Presets against a table of their sources (value, paper, section), the initialisations the papers and
reference codes state, and VSE++'s order score."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from vsekit.models import create_model
from vsekit.models.losses import order_norm_sim, order_sim
from vsekit.train.config import resolve_config
from vsekit.train.presets import MODEL_DEFAULT_PRESET, PRESETS

FNE = "FNE paper (Vilalta et al., SWJ), Table 1"
FNE_L = "FNE authors' code, launchers_eval/"
VSEPP = "VSE++ (Faghri et al.) code defaults + README"
SEAM = "SEAM (Wehrmann et al.) and its reference code"
SMAN = "SMAN (Ji et al., IEEE T-Cyb 2020)"
SGRAF = "SGRAF (Diao et al., AAAI 2021)"
TEMDE = "T-EMDE (Synerise)"

# (preset, option, value, source, section). Every paper preset has rows here (test below).
_fne_common = [("batch_size", 128, FNE_L, "--batch_size 128"), ("grad_clip", 2.0, FNE_L, "--grad_clip 2"),
               ("captions", "one", FNE, "experimental setup: one caption per image and epoch")]
_fne_loss = {
    "sh": [("model", "vse"), ("margin", 0.2), ("max_violation", False), ("lr", 2e-4), ("use_abs", False)],
    "mh": [("model", "vse"), ("margin", 0.2), ("max_violation", True), ("lr", 2e-4)],
    "soe": [("model", "order"), ("similarity", "order"), ("use_abs", True), ("margin", 0.05),
            ("max_violation", False), ("lr", 1e-3)],
    "moe": [("model", "order"), ("use_abs", True), ("margin", 0.05), ("max_violation", True), ("lr", 1e-4)],
    "ph": [("model", "vse"), ("curriculum", True), ("margin", 0.2), ("lr", 2e-4)],
    "poe": [("model", "order"), ("curriculum", True), ("use_abs", True), ("margin", 0.05), ("lr", 1e-3),
            ("lr2", 1e-4)],
    "mh-bl": [("model", "vse"), ("margin", 0.2), ("max_violation", True), ("lr", 2e-4)],
    "soe-bl": [("model", "order"), ("use_abs", True), ("margin", 0.05), ("max_violation", False), ("lr", 1e-3)],
    "moe-bl": [("model", "order"), ("use_abs", False), ("margin", 0.2), ("max_violation", True), ("lr", 2e-4)],
}
_fne_dims = {  # (joint, word) per Table 1 column; launchers_eval/<data>_FNE-<setting>_launcher.sh
    "coco": {"sh": (1536, 1024), "mh": (2048, 1024), "soe": (1536, 1024), "moe": (2048, 1536),
             "ph": (1536, 1024), "poe": (2048, 1024)},
    "f30k": {"sh": (1536, 1024), "mh": (1536, 1024), "soe": (1024, 1024), "moe": (1536, 1536),
             "ph": (1536, 1024), "poe": (1024, 1024)},
    "f8k": {"sh": (1536, 1024), "mh": (1024, 1024), "soe": (1024, 1024), "moe": (1536, 1536),
            "ph": (1536, 1024), "poe": (1024, 1024)},
}
SOURCES: list[tuple[str, str, object, str, str]] = []
for _data, _dims in _fne_dims.items():
    for _setting, _loss in _fne_loss.items():
        _name = _setting if _data == "coco" else f"{_data}-{_setting}"
        _col = f"{_data} column, {_setting.upper()}"
        embed, word = _dims.get(_setting, (1024, 300))
        SOURCES += [(_name, k, v, FNE, _col) for k, v in _loss]
        SOURCES += [(_name, "embed_dim", embed, FNE, _col), (_name, "word_dim", word, FNE, _col)]
        SOURCES += [(_name, k, v, src, sec) for k, v, src, sec in _fne_common]
        # MH-bl is MH too (and its F30K launcher runs 400); F8K MH-bl's launcher runs 400, the text 200
        epochs = 400 if (_data, _setting) in (("f30k", "mh"), ("f30k", "mh-bl")) else 200
        SOURCES.append((_name, "epochs", epochs, FNE, "experimental setup: 200 epochs, 400 for MH on Flickr30K"))

SOURCES += [
    # VSE++: train.py defaults; README "Order++: --measure order --max_violation",
    # "Order0: --measure order --use_abs --margin .05 --learning_rate .001"; model.order_sim
    *[(p, k, v, VSEPP, "train.py defaults") for p in ("vse++", "order++", "order0") for k, v in
      (("embed_dim", 1024), ("word_dim", 300), ("epochs", 30), ("lr_milestones", [15]), ("batch_size", 128),
       ("grad_clip", 2.0), ("captions", "all"))],
    ("vse++", "model", "vse", VSEPP, "README VSE++"), ("vse++", "margin", 0.2, VSEPP, "README VSE++"),
    ("vse++", "max_violation", True, VSEPP, "README VSE++"), ("vse++", "lr", 2e-4, VSEPP, "train.py"),
    ("order++", "model", "order", VSEPP, "README Order++"), ("order++", "margin", 0.2, VSEPP, "README Order++"),
    ("order++", "use_abs", False, VSEPP, "README Order++"), ("order++", "max_violation", True, VSEPP, "README"),
    ("order++", "lr", 2e-4, VSEPP, "README Order++"), ("order++", "similarity", "order-norm", VSEPP, "order_sim"),
    ("order0", "use_abs", True, VSEPP, "README Order0"), ("order0", "margin", 0.05, VSEPP, "README Order0"),
    ("order0", "lr", 1e-3, VSEPP, "README Order0"), ("order0", "max_violation", False, VSEPP, "README Order0"),
    ("order0", "similarity", "order-norm", VSEPP, "model.order_sim"),
    # SEAM
    *[(p, k, v, SEAM, sec) for p in ("seam-e", "seam-c", "seam-g") for k, v, sec in
      (("word_dim", 300, "experimental setup"), ("embed_dim", 1024, "experimental setup"), ("margin", 0.05, "experimental setup: order loss"),
       ("lr", 1e-3, "experimental setup"), ("lr_milestones", [15], "experimental setup"), ("epochs", 30, "experimental setup"),
       ("batch_size", 128, "experimental setup"), ("captions", "all", "reference code: every caption per epoch"),
       ("grad_clip", 1.0, "reference code: --grad_clip 1"), ("model_args.att_units", 300, "experimental setup"),
       ("model_args.penalty_weight", 0.5, "loss: lambda of the attention penalty"))],
    ("seam-e", "model_args.hops", 30, SEAM, "experimental setup"), ("seam-c", "model_args.hops", 10, SEAM, "experimental setup"),
    ("seam-g", "model_args.hops", 30, SEAM, "experimental setup"), ("seam-g", "model_args.gru_dim", 512, SEAM, "experimental setup"),
    *[(p, "similarity", "order", SEAM, "order embeddings (Vendrov et al.'s score; the code: VSE++'s norm)")
      for p in ("seam-e", "seam-c", "seam-g")],
    # SMAN
    *[("sman", k, v, SMAN, sec) for k, v, sec in
      (("optimizer", "adadelta", "Sec. IV-B"), ("lr", 0.05, "Sec. IV-B"), ("weight_decay", 5e-4, "Sec. IV-B"),
       ("grad_clip", 0.1, "Sec. IV-B"), ("epochs", 60, "Sec. IV-B"), ("lr_milestones", [50], "Sec. IV-B"),
       ("batch_size", 128, "Sec. IV-B"), ("margin", 0.2, "Sec. IV-B, m1"), ("max_violation", True, "Sec. III-D"),
       ("embed_dim", 512, "Sec. IV-A-3"), ("word_dim", 512, "Sec. IV-A-3: every embedding 512"),
       ("model_args.dropout", 0.3, "Sec. IV-B"))],
    # SAF / SGR and T-EMDE
    *[(p, k, v, SGRAF, "Sec. 4.2") for p in ("saf-coco", "sgr-coco", "saf-f30k", "sgr-f30k", "saf-temde-f30k",
                                             "sgr-temde-f30k") for k, v in
      (("optimizer", "adam"), ("lr", 2e-4), ("margin", 0.2), ("max_violation", True), ("grad_clip", 2.0),
       ("batch_size", 128), ("embed_dim", 1024), ("word_dim", 300), ("model_args.sim_dim", 256),
       ("captions", "all"))],
    ("saf-coco", "epochs", 20, SGRAF, "Sec. 4.2"), ("saf-coco", "lr_milestones", [10], SGRAF, "Sec. 4.2"),
    ("sgr-coco", "epochs", 20, SGRAF, "Sec. 4.2"), ("sgr-coco", "lr_milestones", [10], SGRAF, "Sec. 4.2"),
    ("saf-f30k", "epochs", 30, SGRAF, "Sec. 4.2"), ("saf-f30k", "lr_milestones", [20], SGRAF, "Sec. 4.2"),
    ("sgr-f30k", "epochs", 40, SGRAF, "Sec. 4.2"), ("sgr-f30k", "lr_milestones", [30], SGRAF, "Sec. 4.2"),
    ("saf-temde-f30k", "epochs", 30, SGRAF, "Sec. 4.2"), ("sgr-temde-f30k", "epochs", 40, SGRAF, "Sec. 4.2"),
    ("saf-temde-f30k", "model_args.global_module", "t-emde", TEMDE, "the SGRAF global module replaced"),
    ("sgr-temde-f30k", "model_args.global_module", "t-emde", TEMDE, "the SGRAF global module replaced"),
    ("saf-temde-f30k", "model_args.temde_divisions", 16, TEMDE, "Flickr30K: 16 divisions"),
    ("sgr-temde-f30k", "model_args.temde_divisions", 16, TEMDE, "Flickr30K: 16 divisions"),
]
DEMO_PRESETS = {"demo", "sman-demo", "sgraf-demo"}


def _value(cfg, key):
    if key.startswith("model_args."):
        return cfg.model_args.get(key.split(".", 1)[1])
    return getattr(cfg, key)


@pytest.mark.parametrize("preset", sorted({row[0] for row in SOURCES}))
def test_preset_matches_its_sources(preset):
    cfg = resolve_config(None, [preset])
    wrong = [f"{key}={_value(cfg, key)!r}, {src} ({sec}) says {value!r}"
             for p, key, value, src, sec in SOURCES if p == preset and _value(cfg, key) != value]
    assert not wrong, f"preset {preset}: " + "; ".join(wrong)


def test_every_paper_preset_has_sources():
    sourced = {row[0] for row in SOURCES}
    assert set(PRESETS) - DEMO_PRESETS <= sourced, sorted(set(PRESETS) - DEMO_PRESETS - sourced)
    assert all(resolve_config(None, [p]).model for p in set(PRESETS) - DEMO_PRESETS)


def test_model_order_alone_does_not_start_from_a_setting_that_never_trains():
    cfg = resolve_config("order")
    assert cfg.presets == ["order0"] and cfg.max_violation is False       # sum of hinges trains
    never = resolve_config(None, ["moe-bl"])                              # FNE paper: never trains
    assert (cfg.use_abs, cfg.margin, cfg.max_violation) != (never.use_abs, never.margin, never.max_violation)
    for model, preset in MODEL_DEFAULT_PRESET.items():
        assert resolve_config(model).model == model and preset in PRESETS


def test_order_norm_is_vsepp_order_score():
    """VSE++ model.order_sim: -sqrt(sum(max(0, c - i)^2)); ranks equal the squared violation's."""
    rng = np.random.default_rng(0)
    img, cap = rng.random((7, 5)), rng.random((9, 5))
    ref = -np.sqrt((np.maximum(0.0, cap[None, :, :] - img[:, None, :]) ** 2).sum(-1))
    got = order_norm_sim(torch.tensor(img), torch.tensor(cap)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    fused = order_norm_sim(torch.tensor(img, dtype=torch.float32), torch.tensor(cap, dtype=torch.float32))
    np.testing.assert_allclose(fused.numpy(), ref, rtol=1e-5, atol=1e-6)
    sq = order_sim(torch.tensor(img), torch.tensor(cap)).numpy()
    assert (np.argsort(-sq, 1) == np.argsort(-got, 1)).all()
    # a caption below its image violates nothing: score 0 and a finite (zero) gradient, never NaN
    i = torch.tensor([[1.0, 1.0]], requires_grad=True)
    c = torch.tensor([[0.5, 0.2], [2.0, 1.0]], requires_grad=True)
    s = order_norm_sim(i, c)
    assert s.tolist() == [[0.0, -1.0]]
    s.sum().backward()
    assert torch.isfinite(i.grad).all() and torch.isfinite(c.grad).all()
    assert c.grad[0].tolist() == [0.0, 0.0] and c.grad[1].tolist() == [-1.0, 0.0]


# -- initialisation ------------------------------------------------------------------------------
def _xavier_bound(w: torch.Tensor) -> float:
    fan_out, fan_in = w.shape[0], w.shape[1]
    field = int(np.prod(w.shape[2:])) if w.dim() > 2 else 1
    return math.sqrt(6.0 / (fan_in * field + fan_out * field))


def _assert_xavier(w: torch.Tensor, name: str):
    w = w.detach()
    r = _xavier_bound(w)
    assert float(w.abs().max()) <= r * (1 + 1e-6), name
    if w.numel() >= 2000:   # U(-r, r) has std r / sqrt(3); torch's default would be ~1/sqrt(3) of that
        assert abs(float(w.std()) - r / math.sqrt(3)) < 0.06 * r, name


@pytest.mark.parametrize("model", ["saf", "sgr"])
def test_sgraf_init_xavier_weights_zero_biases_uniform_embeddings(model):
    torch.manual_seed(0)
    m = create_model(model, img_shape=(36, 2048), vocab_size=300, embed_dim=1024, word_dim=300, sim_dim=256)
    linears = [(n, x) for n, x in m.named_modules() if isinstance(x, nn.Linear)]
    assert len(linears) >= 8
    for name, lin in linears:
        _assert_xavier(lin.weight, name)
        assert lin.bias is None or float(lin.bias.detach().abs().max()) == 0.0, name
    e = m.embed.weight.detach()
    assert float(e.abs().max()) <= 0.1 and abs(float(e.std()) - 0.2 / math.sqrt(12)) < 0.003


def test_seam_init_xavier():
    torch.manual_seed(0)
    m = create_model("seam-c", img_shape=(1536,), vocab_size=300, word_dim=300, hops=10, att_units=300)
    layers = [(n, x) for n, x in m.txt_enc.named_modules() if isinstance(x, (nn.Linear, nn.Conv1d))]
    assert len(layers) >= 9
    for name, layer in layers:
        _assert_xavier(layer.weight, name)
    assert float(m.txt_enc.embed.weight.detach().abs().max()) <= 0.1


def test_sman_init_xavier_word_embeddings_and_512_words():
    torch.manual_seed(0)
    m = create_model("sman", img_shape=(7, 7, 2048), vocab_size=3000)
    assert m.embed.weight.shape == (3000, 512)
    _assert_xavier(m.embed.weight, "embed")
