"""Every backbone family through the extractor, against timm's / torchvision's own computation on
the same weights: a CNN (NCHW), a channels-last model (Swin: NHWC stages) and a ViT (tokens), for
``global``, ``fne`` and ``grid``; plus the VGG taps of the FNE paper (VGG-16, 12,416 features) and a
tap on a Linear layer followed by an in-place ReLU.

References are computed with plain forwards of a separately built model that loads the extractor's
state dict: ``forward_head(forward_features(x), pre_logits=True)`` for global features and the
NCHW maps of ``forward_intermediates`` (spatially averaged by hand) for FNE and grids.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")
timm = pytest.importorskip("timm")

from vsekit.cli import main  # noqa: E402
from vsekit.extract import make_plan  # noqa: E402
from vsekit.extract.extractor import Extractor  # noqa: E402

torch.set_num_threads(1)
SWIN, VIT = "swin_tiny_patch4_window7_224", "vit_tiny_patch16_224"


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _crops(size: int, n: int = 2, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, 1, 3, size, size), dtype=np.uint8))


def _normalised(crops: torch.Tensor, plan) -> torch.Tensor:
    x = crops[:, 0].float() / 255.0
    return (x - torch.tensor(plan.mean).view(1, 3, 1, 1)) / torch.tensor(plan.std).view(1, 3, 1, 1)


def _timm_twin(name: str, ex: Extractor):
    """A separately built timm model with the extractor's weights (plain NCHW memory format)."""
    ref = timm.create_model(name, pretrained=False)
    ref.load_state_dict(ex.model.state_dict())
    return ref.eval()


def assert_features_close(got, want, what=""):
    want = np.asarray(want, dtype=np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())),
                               err_msg=what)


def _extract(name, kind, **kw):
    plan = make_plan(name, kind, weights="none", seed=3, **kw)
    ex = Extractor(plan)
    crops = _crops(plan.crop_size)
    got = ex.features(crops)
    ex.tapper.close()
    return plan, ex, crops, got


@pytest.fixture()
def build_once(monkeypatch):
    """Extractors of one model share its randomly initialised weights: built once, then copied."""
    import copy

    from vsekit.extract import backbones

    real, built = backbones.build_model, {}

    def build(name, weights="imagenet", seed=0, device="meta"):
        if device == "meta":
            return real(name, weights, seed=seed, device=device)
        if name not in built:
            built[name] = real(name, weights, seed=seed, device=device)
        return copy.deepcopy(built[name])

    monkeypatch.setattr(backbones, "build_model", build)


# --- channels-last (Swin) and ViT against timm --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", [SWIN, VIT])
def test_timm_global_fne_grid_equal_timm_own_features(name, build_once):
    plan, ex, crops, got = _extract(name, "global")
    ref = _timm_twin(name, ex)
    x = _normalised(crops, plan)
    with torch.no_grad():
        pre_logits = ref.forward_head(ref.forward_features(x), pre_logits=True)
    assert got.shape == tuple(pre_logits.shape)
    assert_features_close(got, pre_logits, "global")

    fplan = make_plan(name, "fne", weights="none", seed=3)
    fex = Extractor(fplan)
    fgot = fex.features(crops)
    fex.tapper.close()
    n = len(fplan.taps)
    with torch.no_grad():
        maps = ref.forward_intermediates(x, indices=n, intermediates_only=True)  # NCHW, no prefix tokens
    assert all(m.ndim == 4 for m in maps)
    want = torch.cat([m.mean(dim=(2, 3)) for m in maps], dim=1)
    assert fplan.row_shape == (want.shape[1],)
    assert_features_close(fgot, want, "fne")
    if name == SWIN:  # the figure: 4 stages of 96, 192, 384, 768 channels
        assert fplan.row_shape == (1440,) and [t["layout"] for t in fplan.taps] == ["NHWC"] * 4
    else:  # 12 blocks of 192 channels, averaged over the 196 patch tokens (class token left out)
        assert fplan.row_shape == (12 * 192,) and {t["prefix"] for t in fplan.taps} == {1}

    gplan = make_plan(name, "grid", weights="none", seed=3, grid=7)
    assert gplan.crop_size == 224  # built for 224: the default grid input (448) is not possible
    gex = Extractor(gplan)
    ggot = gex.features(crops)
    gex.tapper.close()
    last = maps[-1]
    want = torch.nn.functional.adaptive_avg_pool2d(last, 7).permute(0, 2, 3, 1)
    assert ggot.shape == (2, 7, 7, last.shape[1]) == (2, *gplan.row_shape)
    assert_features_close(ggot, want, "grid")


# --- a CNN (NCHW) against timm ------------------------------------------------------------------------
def test_timm_cnn_global_fne_grid_equal_timm_own_features():
    name = "test_resnet"
    plan, ex, crops, got = _extract(name, "global", input_size=64, resize=64)
    ref = _timm_twin(name, ex)
    x = _normalised(crops, plan)
    with torch.no_grad():
        assert_features_close(got, ref.forward_head(ref.forward_features(x), pre_logits=True), "global")
        stages = ref.forward_intermediates(x, intermediates_only=True)  # act1, layer1..layer4
    fplan = make_plan(name, "fne", weights="none", seed=3, input_size=64, resize=64,
                      taps="layer1,layer2,layer3,layer4")
    fex = Extractor(fplan)
    fex.model.load_state_dict(ex.model.state_dict())
    fgot = fex.features(crops)
    fex.tapper.close()
    assert_features_close(fgot, torch.cat([m.mean(dim=(2, 3)) for m in stages[1:]], dim=1), "fne")
    gplan = make_plan(name, "grid", weights="none", seed=3, input_size=128, grid=2)
    gex = Extractor(gplan)
    gex.model.load_state_dict(ex.model.state_dict())
    gcrops = _crops(128)
    ggot = gex.features(gcrops)
    gex.tapper.close()
    with torch.no_grad():
        last = ref.forward_intermediates(_normalised(gcrops, gplan), intermediates_only=True)[-1]
    assert_features_close(ggot, torch.nn.functional.adaptive_avg_pool2d(last, 2).permute(0, 2, 3, 1), "grid")


# --- torchvision VGG: the FNE paper's VGG-16 and the in-place ReLU after a Linear tap -----------------
@pytest.fixture(scope="module")
def vgg16_fne():
    """The default VGG-16 FNE plan at a 32-px input, its features of ``_crops(32)``, and the model
    with the extractor's hooks removed (for the by-hand references)."""
    plan = make_plan("vgg16", "fne", weights="none", seed=2, input_size=32, resize=32)
    ex = Extractor(plan)
    got = ex.features(_crops(32))
    ex.tapper.close()
    return plan, ex.model, got


def test_vgg16_fne_is_the_papers_12416_features():
    plan = make_plan("vgg16", "fne", weights="none")
    widths = [t["width"] for t in plan.taps]
    # 13 conv layers (2x64, 2x128, 3x256, 3x512, 3x512) + fc6 + fc7, each after its ReLU
    assert widths == [64] * 2 + [128] * 2 + [256] * 3 + [512] * 6 + [4096, 4096]
    assert plan.row_shape == (12416,) and plan.crop_size == 224 and plan.resize == 256
    import torchvision

    with torch.device("meta"):
        tv = torchvision.models.vgg16(weights=None)
    conv_relus = [f"features.{i}" for i, m in enumerate(tv.features)
                  if isinstance(m, torch.nn.ReLU) and isinstance(tv.features[i - 1], torch.nn.Conv2d)]
    assert plan.tap_names == conv_relus + ["classifier.1", "classifier.4"]


def test_vgg16_fne_values_equal_torchvision_by_hand(vgg16_fne):
    plan, model, got = vgg16_fne
    crops = _crops(32)
    x = _normalised(crops, plan)
    cols = {t["name"]: (t["start"], t["stop"]) for t in plan.taps}
    with torch.no_grad():
        conv2 = model.features[:4](x)  # conv1_2 after its ReLU
        fc6 = torch.relu(model.classifier[0](torch.flatten(model.avgpool(model.features(x)), 1)))
        fc7 = torch.relu(model.classifier[3](fc6))
    a, b = cols["features.3"]
    assert_features_close(got[:, a:b], conv2.mean(dim=(2, 3)), "conv1_2")
    a, b = cols["classifier.1"]
    assert_features_close(got[:, a:b], fc6, "fc6")
    a, b = cols["classifier.4"]
    assert_features_close(got[:, a:b], fc7, "fc7")


def test_linear_tap_before_inplace_relu_keeps_pre_relu_values():
    """torchvision VGG's classifier.1 is ReLU(inplace=True): it must not reach the stored fc6."""
    plan = make_plan("vgg19", "fne", weights="none", seed=2, input_size=32, resize=32,
                     taps="classifier.0,classifier.3")
    ex = Extractor(plan)
    crops = _crops(32)
    got = ex.features(crops)
    ex.tapper.close()
    m = ex.model
    with torch.no_grad():
        fc6 = m.classifier[0](torch.flatten(m.avgpool(m.features(_normalised(crops, plan))), 1))
        fc7 = m.classifier[3](torch.relu(fc6))
    assert (fc6 < 0).any()  # else the test could not see a ReLU
    assert_features_close(got[:, :4096], fc6, "classifier.0 (fc6 before ReLU)")
    assert_features_close(got[:, 4096:], fc7, "classifier.3 (fc7 before ReLU)")


def test_vgg19_still_13696():
    assert make_plan("vgg19", "fne", weights="none").row_shape == (13696,)


# --- layouts that cannot be handled are refused with an Error line ------------------------------------
def test_unsupported_combinations_are_error_lines(tmp_path):
    from vsekit.storage import FeatureStore
    from PIL import Image

    root = tmp_path / "img"
    root.mkdir()
    Image.new("RGB", (40, 30), (5, 6, 7)).save(root / "a.png")
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t", image_root=root)
    store.write_images(["a"], ["a.png"], ["train"])
    base = ["extract", "--store", str(store.path), "--weights", "none", "--no-progress", "--workers", "0"]
    for args, msg in [(["--model", VIT, "--kind", "grid", "--input-size", "448"], "does not run at input size 448"),
                      (["--model", VIT, "--kind", "grid", "--grid", "15"], "--grid 15")]:
        r = CliRunner().invoke(main, base + args)
        assert r.exit_code == 1 and r.output.startswith("Error:") and msg in r.output, (args, r.output)
        assert "Traceback" not in r.output
    # a ViT grid works (it ended in a traceback before): its patch tokens as a 10x10 grid, pooled to 5
    r = CliRunner().invoke(main, base + ["--model", "test_vit", "--kind", "grid", "--grid", "5",
                                         "--input-size", "160"])
    assert r.exit_code == 0 and r.exception is None, r.output
    fs = FeatureStore.open(store.path).features("test_vit_grid")
    assert fs.data.shape == (1, 5, 5, 64) and fs.status[:].tolist() == [1]
    assert fs.attrs["taps"][0]["layout"] == "NLC" and fs.attrs["taps"][0]["prefix"] == 1


def test_ambiguous_layout_is_refused_not_guessed():
    """A fixed-size model whose map is 8x8x8: NCHW or NHWC cannot be told, so the tap is refused."""
    from vsekit.extract.taps import check_layout, detect_layouts, probe

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 4, stride=4)

        def forward(self, x):
            assert x.shape[-1] == 32, "built for 32x32"
            return self.conv(x)

    model = Fixed().to("meta")
    info = probe(model, 32, ["conv"])["conv"]
    assert info.shape == (8, 8, 8)
    layouts = detect_layouts(model, 32, ["conv"])
    assert layouts["conv"] is None
    with pytest.raises(ValueError, match="cannot tell the layout"):
        check_layout("fixed", info, layouts["conv"])


def test_list_layers_shows_channels_of_channels_last_stages():
    r = CliRunner().invoke(main, ["extract", "--model", SWIN, "--list-layers"])
    assert r.exit_code == 0, r.output
    line = next(l for l in r.output.splitlines() if l.startswith("layers.0 "))
    assert "(56, 56, 96)" in line and " 96 NHWC" in line and line.rstrip().endswith("*")


@pytest.mark.parametrize("name", ["convnext_atto", "test_vit"])
def test_timm_global_is_timms_pre_logits(name):
    """The global feature is what timm's head gives before its classifier (ConvNeXt: after the head's
    norm; ViT: the class token after fc_norm)."""
    plan, ex, crops, got = _extract(name, "global", input_size=64 if name == "convnext_atto" else None)
    ref = _timm_twin(name, ex)
    with torch.no_grad():
        want = ref.forward_head(ref.forward_features(_normalised(crops, plan)), pre_logits=True)
    assert_features_close(got, want, name)


def test_swin_window_partitioned_layers_are_not_taps():
    """Inside a Swin block the attention sees (B * windows, 49, C): not one row per image."""
    with pytest.raises(ValueError, match="matches no layer"):
        make_plan(SWIN, "fne", weights="none", taps="layers.0.blocks.0.attn.qkv")
    plan = make_plan(SWIN, "fne", weights="none", taps="layers.0.blocks.0.attn*,layers.0")
    assert plan.tap_names == ["layers.0"] and plan.taps[0]["layout"] == "NHWC"
