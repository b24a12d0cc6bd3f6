"""``vsekit extract`` against an independent PIL + torchvision pipeline with the same weights (issue 47).

The reference: ``Image.open`` → RGB → ``T.Resize`` (PIL, bilinear) → ``T.CenterCrop`` / ``T.TenCrop``
→ ``ToTensor`` → ``Normalize`` (ImageNet), then the torchvision model built the way ``--weights none``
builds it (``torch.manual_seed(0)``, random initialisation), run in float64 by hand: VGG-19's fc7
after ReLU (global), every conv after ReLU plus fc6 / fc7 (FNE), the convs before ReLU (``--taps``),
ResNet-152's layer4 pooled to a grid. vsekit runs the model in float32; its bound against the float64
reference is ``F32``. The JPEGs are made here, one of them at least twice the resize in both sides (the
case where ``turbo``'s DCT scaling decodes at half size).

- ``--decoder pil`` has PIL's pixels exactly: within ``F32`` of the reference.
- The default of a new set (``torchvision``: full-size decode, torch's resize) is within 1e-3 relative
  per image of ``pil`` at the papers' sizes (COCO's 640x480 and a 512x600 JPEG at resize 256, VGG-19),
  and within ``SMALL_BOUND`` of the reference at this file's small sizes, the big JPEG included.
- ``turbo`` (DCT scaling, an option) is not: on the 512x600 JPEG it is off by more than 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
tv = pytest.importorskip("torchvision")

from vsekit.extract import extract  # noqa: E402
from vsekit.storage import FeatureStore  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]   # VGG-19 and ResNet-152 in float64: minutes

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
RESIZE, CROP = 72, 64
#: vsekit's float32 forward against the float64 reference, relative per image: the pixels are the
#: same, so only float32 rounding through at most 152 layers separates them (measured ~1e-6)
F32 = 1e-4
#: the default decoder's promise: within 1e-3 relative per image of PIL's pixels' features, at the
#: papers' sizes (photos resized to 256, crops of 224; the issue measured 4e-5 to 7e-4)
DEFAULT_BOUND = 1e-3
#: the same at this file's small sizes (crops of 64), where the one grey level by which torch's resize
#: differs from PIL's on ~1% of the pixels weighs more (measured up to 3.3e-3)
SMALL_BOUND = 1e-2
#: (width, height): landscape, portrait, and "big", at least twice the resize (72 → 80x72) in both sides
SIZES = {"land": (120, 94), "port": (90, 116), "big": (200, 180)}


def photo(w: int, h: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x * 200 / w, y * 150 / h + 40, (x + y) * 0.3 + 20], -1)
    return np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    (root / "img").mkdir()
    for i, (name, (w, h)) in enumerate(SIZES.items()):
        Image.fromarray(photo(w, h, i)).save(root / "img" / f"{name}.jpg", quality=88)
    s = FeatureStore.create(root / "s.zarr", dataset="t", image_root=root / "img")
    s.write_images(list(SIZES), [f"{n}.jpg" for n in SIZES], ["train"] * len(SIZES))
    return s


# --- the reference ------------------------------------------------------------------------------------
def reference_inputs(path, resize: int, crop: int, n_crops: int, square: bool = False):
    """float64 (n_crops, 3, crop, crop): PIL decode and resize, torchvision's crops and normalisation."""
    import torchvision.transforms as T

    with Image.open(path) as im:
        img = T.Resize((resize, resize) if square else resize, T.InterpolationMode.BILINEAR)(im.convert("RGB"))
    # the papers' 10 crops (Caffe's oversample): five crops, then the mirror of each (torchvision's
    # TenCrop crops the mirrored image instead: its mirrored centre crop moves a pixel on odd margins)
    five = T.functional.five_crop(img, crop)
    crops = [T.CenterCrop(crop)(img)] if n_crops == 1 else [*five, *(T.functional.hflip(c) for c in five)]
    norm = T.Normalize(MEAN, STD)
    return torch.stack([norm(T.functional.to_tensor(c).double()) for c in crops])


def reference_model(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build(weights=None).eval().double()


def vgg_taps(model, x, which: str):
    """VGG-19 in float64, layer by layer: ``global`` fc7 after ReLU; ``fne`` each conv's spatial mean
    after its ReLU, then fc6, fc7 after ReLU; ``pre`` each conv's spatial mean before its ReLU."""
    out = []
    for layer in model.features:
        y = layer(x)
        if which == "fne" and isinstance(layer, torch.nn.ReLU):
            out.append(y.mean((2, 3)))
        if which == "pre" and isinstance(layer, torch.nn.Conv2d):
            out.append(y.mean((2, 3)))
        x = y
    if which == "pre":
        return torch.cat(out, 1)
    h = torch.flatten(model.avgpool(x), 1)
    fc6 = model.classifier[1](model.classifier[0](h))
    fc7 = model.classifier[4](model.classifier[3](fc6))
    return fc7 if which == "global" else torch.cat(out + [fc6, fc7], 1)


def resnet_grid(model, x, grid: int):
    m = model
    x = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    x = m.layer4(m.layer3(m.layer2(m.layer1(x))))
    return torch.nn.functional.adaptive_avg_pool2d(x, grid).permute(0, 2, 3, 1)


def relative(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """||got - want|| / ||want|| per image (row)."""
    g, w = got.reshape(len(got), -1).astype(np.float64), want.reshape(len(want), -1)
    return np.linalg.norm(g - w, axis=1) / np.linalg.norm(w, axis=1)


CONVS = ",".join(f"features.{i}" for i in (0, 2, 5, 7, 10, 12, 14, 16, 19, 21, 23, 25, 28, 30, 32, 34))
CASES = {   # id: (model, kind, crops, extra extract options)
    "vgg19-global-1": ("vgg19", "global", 1, {}),
    "vgg19-global-10": ("vgg19", "global", 10, {}),
    "vgg19-fne-1": ("vgg19", "fne", 1, {}),
    "vgg19-fne-10": ("vgg19", "fne", 10, {}),
    "vgg19-pre-relu-10": ("vgg19", "fne", 10, {"taps": CONVS}),
    "resnet152-grid": ("resnet152", "grid", 1, {"grid": 2, "resize": 64, "input_size": 64}),
}


def reference(store, case: str) -> np.ndarray:
    model_name, kind, crops, extra = CASES[case]
    rows = []
    with torch.no_grad():
        if model_name == "vgg19":
            m = reference_model(tv.models.vgg19)
            which = "pre" if "taps" in extra else "fne" if kind == "fne" else "global"
            for r in range(store.n_images):
                rows.append(vgg_taps(m, reference_inputs(store.image_file(r), RESIZE, CROP, crops), which).mean(0))
        else:
            m = reference_model(tv.models.resnet152)
            for r in range(store.n_images):
                x = reference_inputs(store.image_file(r), extra["resize"], extra["input_size"], 1, square=True)
                rows.append(resnet_grid(m, x, extra["grid"])[0])
    return torch.stack(rows).numpy()


def vsekit_features(store, case: str, name: str, **decoder) -> tuple[np.ndarray, dict]:
    model_name, kind, crops, extra = CASES[case]
    opts = {"resize": RESIZE, "input_size": CROP, **extra}
    res = extract(store, model_name, kind, name=name, weights="none", crops=crops, dtype="float32",
                  workers=0, batch_size=2, progress=False, **opts, **decoder)
    assert res.failed == 0, res.errors
    fs = FeatureStore.open(store.path).features(name)
    return np.asarray(fs.data[:]), dict(fs.attrs)


@pytest.mark.parametrize("case", list(CASES))
def test_pil_and_the_default_decoder_give_the_reference_pipelines_features(store, case):
    want = reference(store, case)
    pil, _ = vsekit_features(store, case, f"{case}-pil", decoder="pil")
    assert relative(pil, want).max() < F32, relative(pil, want)
    new, attrs = vsekit_features(store, case, f"{case}-new")   # a new set, no --decoder
    assert attrs["decoder"] == "torchvision" and attrs["decoding"]["draft"] is False
    rel = relative(new, want)
    assert rel.max() < SMALL_BOUND, dict(zip(SIZES, rel))


def test_at_the_papers_sizes_the_default_is_within_1e_3_of_pil_and_turbo_is_not(tmp_path):
    """Photo-like JPEGs of COCO's size (640x480), the issue's 512x600 (shorter side twice the resize)
    and 800x600, resize 256, 10 crops of 224, VGG-19 (random weights) fc7: the default decoder's features
    are within 1e-3 relative per image of ``pil``'s; ``turbo``, which decodes the 512x600 JPEG at half
    size by DCT scaling, is off by more on that one. The same float32 model on each decoder's crops,
    so only the pixels differ."""
    from vsekit.extract.extractor import Extractor
    from vsekit.extract.images import DEFAULT_DECODER, decode_crops
    from vsekit.extract.plan import make_plan

    paths = []
    for i, (w, h) in enumerate(((640, 480), (512, 600), (800, 600))):
        paths.append(tmp_path / f"{w}x{h}.jpg")
        Image.fromarray(photo(w, h, 10 + i)).save(paths[-1], quality=90)
    ex = Extractor(make_plan("vgg19", "global", weights="none", crops=10, resize=256, input_size=224))

    def feats(decoder):
        return ex.features(torch.from_numpy(np.stack([decode_crops(p, 256, 224, 10, decoder=decoder)
                                                      for p in paths])))

    pil = feats("pil")
    default = relative(feats(DEFAULT_DECODER), pil)
    turbo = relative(feats("turbo"), pil)
    assert default.max() < DEFAULT_BOUND, default   # measured 4.7e-4, 0 (an exact halving), -
    # 640x480 is under twice 341x256: no DCT scaling; the others are decoded at half size (measured 5.1e-2)
    assert turbo[0] < DEFAULT_BOUND < min(turbo[1:]), turbo
