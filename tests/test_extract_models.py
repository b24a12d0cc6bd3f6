"""Backbones, widths of every kind, FNE taps and the 10-crop average, checked against independent
references: a plain forward hook, crops cut by hand with numpy, separate single-crop passes."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

torch = pytest.importorskip("torch")

from vsekit.cli import main  # noqa: E402
from vsekit.extract import build_model, extract, make_plan  # noqa: E402
from vsekit.extract.extractor import Extractor  # noqa: E402

torch.set_num_threads(1)


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


# --- widths (meta device: no weights, no compute) --------------------------------------------------
@pytest.mark.parametrize("model,kind,shape", [
    ("vgg19", "fne", (13696,)),
    ("vgg19", "global", (4096,)),
    ("inception_resnet_v2", "global", (1536,)),
    ("resnet152", "global", (2048,)),
    ("resnet152", "grid", (7, 7, 2048)),
    ("resnet152", "regions", (36, 2048)),
    ("inception_resnet_v2", "regions", (36, 1536)),
    ("vgg19", "grid", (7, 7, 512)),
])
def test_widths_of_every_kind(model, kind, shape, tmp_path):
    boxes = None
    if kind == "regions":
        boxes = tmp_path / "b.json"
        boxes.write_text("{}")
    plan = make_plan(model, kind, weights="none", boxes=str(boxes) if boxes else None)
    assert plan.row_shape == shape
    if kind in ("fne", "global"):
        assert plan.taps[-1]["stop"] == shape[0]
        assert all(t["stop"] - t["start"] == t["width"] for t in plan.taps)


def test_vgg19_fne_taps_are_every_conv_relu_plus_fc6_fc7():
    plan = make_plan("vgg19", "fne", weights="none")
    widths = [t["width"] for t in plan.taps]
    # 16 conv layers (2x64, 2x128, 4x256, 4x512, 4x512) then fc6 and fc7, each after ReLU
    assert widths == [64] * 2 + [128] * 2 + [256] * 4 + [512] * 8 + [4096, 4096]
    assert sum(widths[:16]) == 5504
    model = build_model("vgg19", "none", device="meta")
    for t in plan.taps[:16]:
        name = t["name"]
        idx = int(name.split(".")[1])
        assert isinstance(model.features[idx], torch.nn.ReLU)
        assert isinstance(model.features[idx - 1], torch.nn.Conv2d)
    assert [t["name"] for t in plan.taps[16:]] == ["classifier.1", "classifier.4"]


def test_grid_14_keeps_layer4_whole():
    assert make_plan("resnet152", "grid", weights="none", grid=14).row_shape == (14, 14, 2048)
    with pytest.raises(ValueError, match="--grid 15"):
        make_plan("resnet152", "grid", weights="none", grid=15)


def test_unknown_names_list_choices():
    with pytest.raises(ValueError, match="valid choices: inception_resnet_v2, resnet152, vgg16, vgg19"):
        make_plan("no_such_net", "global", weights="none")
    with pytest.raises(ValueError, match="--kind 'pixels'; valid choices: global, fne, grid, regions"):
        make_plan("vgg19", "pixels", weights="none")
    with pytest.raises(ValueError, match="matches no layer"):
        make_plan("vgg19", "fne", weights="none", taps="nothing*")


def test_list_layers_cli():
    r = CliRunner().invoke(main, ["extract", "--model", "vgg19", "--list-layers"])
    assert r.exit_code == 0, r.output
    line = next(l for l in r.output.splitlines() if l.startswith("classifier.4 "))
    assert "4096" in line and line.rstrip().endswith("*")
    line = next(l for l in r.output.splitlines() if l.startswith("features.0 "))
    assert "(64, 224, 224)" in line and not line.rstrip().endswith("*")  # the conv, not its ReLU


# --- weights ---------------------------------------------------------------------------------------
def test_weights_none_is_seeded_and_path_loads(tmp_path):
    a = build_model("test_resnet", "none", seed=5, device="cpu")
    b = build_model("test_resnet", "none", seed=5, device="cpu")
    c = build_model("test_resnet", "none", seed=6, device="cpu")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": sc}, path)
    d = build_model("test_resnet", str(path), device="cpu")
    assert all(torch.equal(d.state_dict()[k], sc[k]) for k in sc)
    torch.save({"fc.weight": torch.zeros(3)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt does not match"):
        build_model("test_resnet", str(tmp_path / "bad.pt"), device="cpu")
    with pytest.raises(ValueError, match="not 'imagenet', 'none' or an existing checkpoint"):
        build_model("test_resnet", str(tmp_path / "missing.pt"), device="cpu")


def test_failed_download_suggests_weights_path(monkeypatch):
    import timm

    def offline(*a, **k):
        raise OSError("network is unreachable")

    monkeypatch.setattr(timm, "create_model", offline)
    with pytest.raises(ValueError, match=r"--weights PATH"):
        build_model("test_resnet", "imagenet", device="cpu")


# --- values against independent references ---------------------------------------------------------
def _plain_forward(model, names, x):
    """Activations of ``names`` from a plain forward hook (full maps kept)."""
    acts = {}
    hooks = [dict(model.named_modules())[n].register_forward_hook(
        lambda m, i, o, n=n: acts.__setitem__(n, o.detach().clone())) for n in names]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return acts


def _normalise(crop_hwc_uint8, mean, std):
    x = torch.from_numpy(crop_hwc_uint8.astype(np.float32) / 255.0).permute(2, 0, 1)
    return (x - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


@pytest.mark.parametrize("model", ["test_resnet", "vgg19"])
def test_fne_tap_is_spatial_mean_and_ten_crop_is_mean_of_single_crops(model, tmp_path):
    size, resize = 32, 40
    plan = make_plan(model, "fne", weights="none", seed=1, input_size=size, resize=resize,
                     resize_mode="square", crops=10)
    ex = Extractor(plan)
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (50, 60, 3), dtype=np.uint8)
    # crops by hand: resize to 40x40, corners TL, TR, BL, BR, centre, then mirrors
    big = np.asarray(Image.fromarray(img).resize((resize, resize), Image.Resampling.BILINEAR))
    o, c = resize - size, (resize - size) // 2
    crops = [big[:size, :size], big[:size, o:], big[o:, :size], big[o:, o:], big[c:c + size, c:c + size]]
    crops += [cr[:, ::-1] for cr in crops]
    # the extractor's 10-crop average, through the real image path
    path = tmp_path / "x.png"
    Image.fromarray(img).save(path)
    from vsekit.extract.images import load_image, make_crops

    got_crops = make_crops(load_image(path), resize, size, 10, "square", plan.interpolation)
    assert np.array_equal(got_crops.transpose(0, 2, 3, 1), np.stack(crops))
    feats = ex.features(torch.from_numpy(got_crops)[None])[0]
    one = ex.features(torch.from_numpy(got_crops[4:5])[None])[0]
    ex.tapper.close()  # the reference below uses plain hooks on the same weights
    # reference: ten separate single-crop forward passes with a plain hook, spatial mean by numpy
    names = plan.tap_names
    ref = []
    for cr in crops:
        x = _normalise(np.ascontiguousarray(cr), plan.mean, plan.std)[None]
        acts = _plain_forward(ex.model, names, x)
        vec = []
        for n in names:
            a = acts[n].numpy()[0]
            vec.append(a.reshape(a.shape[0], -1).mean(axis=1) if a.ndim == 3 else a)
        ref.append(np.concatenate(vec))
    ref = np.stack(ref)
    assert ref.shape[1] == plan.row_shape[0]
    np.testing.assert_allclose(feats, ref.mean(axis=0), rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    # every tap's columns equal that layer's spatially averaged activation (centre crop alone)
    for t in plan.taps:
        want = ref[4][t["start"]:t["stop"]]
        np.testing.assert_allclose(one[t["start"]:t["stop"]], want, rtol=1e-4,
                                   atol=1e-5 * max(1e-3, np.abs(want).max()), err_msg=t["name"])
