"""Image decoding and crops: every valid mode becomes the right RGB; bad files raise ImageError."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vsekit.extract.images import ImageError, crop_boxes, load_image, make_crops, resize


@pytest.fixture()
def rgb():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)


def test_grayscale_16bit_palette_cmyk_alpha(tmp_path, rgb):
    gray = rgb[..., 0]
    Image.fromarray(gray, "L").save(tmp_path / "g.png")
    assert np.array_equal(np.asarray(load_image(tmp_path / "g.png")), np.repeat(gray[..., None], 3, 2))
    # 16-bit: value v * 257 maps back to v
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    assert np.array_equal(np.asarray(load_image(tmp_path / "g16.png"))[..., 1], gray)
    # palette: same colours as the palette expands to
    pal = Image.fromarray(rgb).quantize(16)
    pal.save(tmp_path / "p.png")
    assert np.array_equal(np.asarray(load_image(tmp_path / "p.png")), np.asarray(pal.convert("RGB")))
    # CMYK JPEG decodes (values checked loosely: JPEG is lossy)
    cmyk = Image.fromarray(rgb).convert("CMYK")
    cmyk.save(tmp_path / "c.jpg", quality=100)
    out = np.asarray(load_image(tmp_path / "c.jpg"), dtype=np.int16)
    assert out.shape == rgb.shape and np.abs(out - rgb).mean() < 12
    # alpha composited over white: opaque pixels unchanged, transparent ones white
    alpha = np.full(gray.shape, 255, np.uint8)
    alpha[:5] = 0
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(tmp_path / "a.png")
    out = np.asarray(load_image(tmp_path / "a.png"))
    assert np.array_equal(out[5:], rgb[5:]) and (out[:5] == 255).all()


@pytest.mark.parametrize("orientation,k", [(3, 2), (6, 1), (8, -1)])
def test_exif_rotation_is_applied(tmp_path, rgb, orientation, k):
    # the pixels stored the way a camera would, with the tag saying how to display them
    stored = np.rot90(rgb, k=k)
    img = Image.fromarray(np.ascontiguousarray(stored))
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(tmp_path / "r.png", exif=exif)
    assert np.array_equal(np.asarray(load_image(tmp_path / "r.png")), rgb)


def test_bad_files(tmp_path, rgb, monkeypatch):
    (tmp_path / "zero.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("not an image at all")
    Image.fromarray(rgb).save(tmp_path / "ok.jpg")
    data = (tmp_path / "ok.jpg").read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    cases = {"zero.jpg": "zero-byte", "text.jpg": "not an image", "trunc.jpg": "cannot decode",
             "missing.jpg": "missing file"}
    for name, msg in cases.items():
        with pytest.raises(ImageError, match=msg) as e:
            load_image(tmp_path / name)
        assert name in str(e.value)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # 1200 px is over 2x: DecompressionBombError
    with pytest.raises(ImageError, match="decompression-bomb"):
        load_image(tmp_path / "ok.jpg")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # between 1x and 2x: only a warning in PIL
    with pytest.raises(ImageError, match="decompression-bomb"):
        load_image(tmp_path / "ok.jpg")


def test_resize_and_crop_geometry(rgb):
    img = Image.fromarray(rgb)  # 40 wide, 30 high
    assert resize(img, 24).size == (32, 24)               # shorter side to 24
    assert resize(img, 24, "square").size == (24, 24)
    assert crop_boxes(32, 24, 20, 1) == [(6, 2)]
    assert crop_boxes(32, 24, 20, 5) == [(0, 0), (12, 0), (0, 4), (12, 4), (6, 2)]
    crops = make_crops(img, 24, 20, 10)
    assert crops.shape == (10, 3, 20, 20) and crops.dtype == np.uint8
    big = np.asarray(resize(img, 24))
    assert np.array_equal(crops[1].transpose(1, 2, 0), big[0:20, 12:32])
    assert np.array_equal(crops[6], crops[1][:, :, ::-1])  # mirror of crop 1
    with pytest.raises(ValueError, match="--crops 3"):
        make_crops(img, 24, 20, 3)


# --- torchvision's resize, exactly ---------------------------------------------------------------------
@pytest.mark.parametrize("wh", [(451, 300), (300, 451), (500, 333), (333, 500), (257, 256), (700, 9)])
@pytest.mark.parametrize("interp", ["bilinear", "bicubic"])
def test_resize_matches_torchvision_resize(wh, interp):
    """Shorter side to 256, the longer one truncated as torchvision's T.Resize(256) (451x300 → 384,
    not the rounded 385); same pixels, and the centre crop equals T.CenterCrop's."""
    T = pytest.importorskip("torchvision.transforms")
    rng = np.random.default_rng(wh[0])
    img = Image.fromarray(rng.integers(0, 256, (wh[1], wh[0], 3), dtype=np.uint8))
    mode = {"bilinear": T.InterpolationMode.BILINEAR, "bicubic": T.InterpolationMode.BICUBIC}[interp]
    want = T.Resize(256, interpolation=mode)(img)
    got = resize(img, 256, "shorter", interp)
    assert got.size == want.size
    assert np.array_equal(np.asarray(got), np.asarray(want))
    if min(want.size) >= 224 and max(want.size) >= 224:
        crop = T.CenterCrop(224)(want)
        mine = make_crops(img, 256, 224, 1, "shorter", interp)[0].transpose(1, 2, 0)
        assert np.array_equal(mine, np.asarray(crop))


# --- pixel budgets (issue 19: a thin image must not exhaust memory) -------------------------------------
def test_pixel_budgets_fail_before_decoding_or_resizing(tmp_path, monkeypatch, rgb):
    from vsekit.extract.images import pixel_budgets

    assert pixel_budgets() == (Image.MAX_IMAGE_PIXELS, 16_000_000)
    assert pixel_budgets(1000, 500) == (1000, 500)
    Image.fromarray(rgb).save(tmp_path / "ok.png")  # 40x30 = 1200 px
    with pytest.raises(ImageError, match="40x30 is over the decoded pixel budget .*--max-decoded-pixels"):
        load_image(tmp_path / "ok.png", max_decoded=1000)
    img = load_image(tmp_path / "ok.png")
    with pytest.raises(ImageError, match="resized to 32x24 would be over the resized pixel budget"):
        resize(img, 24, max_resized=500)
    monkeypatch.setenv("VSEKIT_MAX_RESIZED_PIXELS", "500")   # the environment decides nothing (it used to)
    monkeypatch.setenv("VSEKIT_MAX_DECODED_PIXELS", "1000")
    assert resize(load_image(tmp_path / "ok.png"), 24).size == (32, 24)


def test_thin_image_is_marked_failed_without_resizing(tmp_path, monkeypatch):
    """A 20000x2 PNG at --resize 256 would become 2,560,000x256 (655 Mpx, ~2 GB): it is failed with
    the reason, and PIL's resize is never called with a size over the budget."""
    pytest.importorskip("torch")
    from vsekit.extract import extract
    from vsekit.storage import FeatureStore

    root = tmp_path / "img"
    root.mkdir()
    thin = np.zeros((2, 20000, 3), dtype=np.uint8)
    thin[:, ::7] = 200
    Image.fromarray(thin).save(root / "thin.png")
    assert (root / "thin.png").stat().st_size < 10_000  # a tiny file
    Image.fromarray(np.full((30, 40, 3), 90, np.uint8)).save(root / "ok.png")
    store = FeatureStore.create(tmp_path / "s.zarr", dataset="t", image_root=root)
    store.write_images(["a", "b"], ["ok.png", "thin.png"], ["train", "train"])
    asked = []
    real = Image.Image.resize

    def spy(self, size, *a, **k):
        asked.append(tuple(size))
        assert size[0] * size[1] <= 16_000_000, f"resize to {size} attempted"
        return real(self, size, *a, **k)

    import torch

    real_interpolate = torch.nn.functional.interpolate

    def torch_spy(x, size=None, **k):   # torchvision's and turbo's resize: (H, W)
        asked.append((size[1], size[0]))
        assert size[0] * size[1] <= 16_000_000, f"resize to {size} attempted"
        return real_interpolate(x, size=size, **k)

    monkeypatch.setattr(Image.Image, "resize", spy)
    monkeypatch.setattr(torch.nn.functional, "interpolate", torch_spy)
    for decoder in ("pil", "torchvision", "turbo"):
        asked.clear()
        res = extract(store, "test_resnet", "global", weights="none", input_size=32, resize=256, workers=0,
                      progress=False, decoder=decoder, name=decoder)
        assert res.failed == 1 and res.done == 1
        reason = res.errors[1]
        assert "20000x2 resized to 2560000x256" in reason and "resized pixel budget" in reason
        assert asked == [(341, 256)], decoder  # only the good image was resized
        fs = FeatureStore.open(store.path).features(decoder)
        assert fs.status[:].tolist() == [1, 2] and "resized pixel budget" in fs.errors()[1]
