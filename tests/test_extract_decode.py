"""The decoding workers' decode → resize → crops (issue 30): ``decode_crops`` returns NHWC crops;
decoder "pil" gives exactly the old reader's pixels, with the same errors; "torchvision" (the default:
torch's resize) and "turbo" (torch's resize, DCT scaling) stay within measured bounds and are part of
the settings."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vsekit.extract.images import (DECODERS, DEFAULT_DECODER, UNRECORDED_DECODER, ImageError, decode_crops,
                                   decoder_attrs, hash_settings, image_crops, load_image, make_crops)

pytest.importorskip("torchvision")


def photo(w=160, h=120, seed=0) -> np.ndarray:
    """A photo-like RGB array: gradients, a blob, noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x * 200 / w, y * 150 / h + 40, (x + y) * 0.3 + 20], -1)
    blob = np.exp(-((x - w / 3) ** 2 + (y - h / 2) ** 2) / (2 * (w / 6) ** 2))[..., None] * np.array([90, -60, 40])
    return np.clip(base + blob + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def numpy_crops(a: np.ndarray, crop: int, n: int) -> np.ndarray:
    """Independent reference: the 10-crop protocol cut from an HWC array with numpy slicing."""
    h, w = a.shape[:2]
    cx, cy = int(round((w - crop) / 2)), int(round((h - crop) / 2))
    boxes = [(cx, cy)] if n == 1 else [(0, 0), (w - crop, 0), (0, h - crop), (w - crop, h - crop), (cx, cy)]
    out = [a[y:y + crop, x:x + crop] for x, y in boxes]
    if n == 10:
        out += [c[:, ::-1] for c in out]
    return np.stack(out)


JPEG_KINDS = {   # name: (PIL mode, save kwargs)
    "420": ("RGB", {"quality": 90}),
    "444": ("RGB", {"quality": 90, "subsampling": 0}),
    "422": ("RGB", {"quality": 85, "subsampling": 1}),
    "progressive": ("RGB", {"quality": 90, "progressive": True}),
    "gray": ("L", {"quality": 90}),
    "cmyk": ("CMYK", {"quality": 95}),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dec")
    out = {}
    for i, (name, (mode, kw)) in enumerate(JPEG_KINDS.items()):
        img = Image.fromarray(photo(161 + i, 120, i))
        img = img.convert(mode) if mode != "RGB" else img
        img.save(root / f"{name}.jpg", **kw)
        out[name] = root / f"{name}.jpg"
    Image.fromarray(photo(150, 131, 9)).save(root / "p.png")
    out["png"] = root / "p.png"
    return out


def decode_rgb(path, decoder="pil"):
    """The full-size decode every ``decode_crops`` starts with (libjpeg-turbo where it can), as the
    extraction runs it: ``images._decode`` with the fast JPEG path and no resize target."""
    from pathlib import Path

    from vsekit.extract import images

    return images._decode(Path(path), decoder, None, "shorter", True)[0]


def test_decode_rgb_equals_pil_for_every_jpeg_kind(files):
    """libjpeg-turbo through torchvision decodes to PIL's pixels exactly (gray replicated, CMYK by PIL)."""
    for name, p in files.items():
        got = decode_rgb(p)
        assert np.array_equal(np.asarray(got), np.asarray(load_image(p))), name
        if name in ("420", "444", "422", "progressive", "gray"):
            assert isinstance(got, np.ndarray), f"{name}: expected the libjpeg-turbo path"


@pytest.mark.parametrize("n_crops", [1, 5, 10])
@pytest.mark.parametrize("mode,interp", [("shorter", "bilinear"), ("square", "bilinear"), ("shorter", "bicubic"),
                                         ("shorter", "nearest"), ("shorter", "lanczos")])
def test_pil_decoder_gives_the_old_readers_pixels(files, n_crops, mode, interp):
    for name, p in files.items():
        old = make_crops(load_image(p), 72, 64, n_crops, mode, interp)      # (n, 3, H, W)
        new = decode_crops(p, 72, 64, n_crops, mode, interp, decoder="pil")  # (n, H, W, 3)
        assert new.shape == (n_crops, 64, 64, 3) and new.dtype == np.uint8 and new.flags.c_contiguous
        assert np.array_equal(new, old.transpose(0, 2, 3, 1)), (name, mode, interp)


def test_crops_equal_an_independent_numpy_cut(files):
    from vsekit.extract.images import resize
    for n in (1, 5, 10):
        for p in files.values():
            ref = numpy_crops(np.asarray(resize(load_image(p), 72)), 64, n)
            assert np.array_equal(decode_crops(p, 72, 64, n), ref)
            assert np.array_equal(image_crops(load_image(p), 72, 64, n), ref)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_on_the_libjpeg_turbo_path(tmp_path, orientation):
    img = Image.fromarray(photo(90, 60, orientation))
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(tmp_path / "o.jpg", quality=92, exif=exif)
    got = decode_rgb(tmp_path / "o.jpg")
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, np.asarray(load_image(tmp_path / "o.jpg")))
    for dec in DECODERS:
        c = decode_crops(tmp_path / "o.jpg", 40, 32, 10, decoder=dec)
        ref = make_crops(load_image(tmp_path / "o.jpg"), 40, 32, 10).transpose(0, 2, 3, 1)
        assert c.shape == ref.shape and np.abs(c.astype(int) - ref).max() <= 1


@pytest.mark.parametrize("decoder", ["torchvision", "turbo"])
def test_torchs_resize_is_within_the_measured_bound(files, decoder):
    """torch's uint8 antialiased resize vs PIL's: at most 1 level, on under 3% of the values
    (measured: about 1%, bench/decode.py photos; docs/gpus_clusters.md). These files are under twice
    the resize: turbo decodes them in full too."""
    for interp in ("bilinear", "bicubic"):
        for mode in ("shorter", "square"):
            for name, p in files.items():
                a = decode_crops(p, 72, 64, 10, mode, interp, decoder="pil").astype(int)
                b = decode_crops(p, 72, 64, 10, mode, interp, decoder=decoder).astype(int)
                d = np.abs(a - b)
                assert d.max() <= 1 and (d > 0).mean() < 0.03, (interp, mode, name, d.max(), (d > 0).mean())
    # nearest / lanczos: PIL's resize under every decoder
    for interp in ("nearest", "lanczos"):
        p = files["420"]
        assert np.array_equal(decode_crops(p, 72, 64, 10, "shorter", interp, decoder),
                              decode_crops(p, 72, 64, 10, "shorter", interp, "pil"))


def test_turbo_uses_dct_scaling_only_from_twice_the_resize(tmp_path, monkeypatch):
    big = Image.fromarray(photo(400, 300, 3))
    big.save(tmp_path / "big.jpg", quality=90)
    asked = []
    real = Image.Image.draft

    def spy(self, mode, size):
        asked.append(size)
        return real(self, mode, size)

    monkeypatch.setattr(Image.Image, "draft", spy)
    from PIL import JpegImagePlugin
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    ref = decode_crops(tmp_path / "big.jpg", 128, 112, 10, decoder="pil").astype(int)
    assert asked == []
    got = decode_crops(tmp_path / "big.jpg", 128, 112, 10, decoder="turbo").astype(int)
    assert asked == [(170, 128)]            # 400x300 is over 2x 170x128: decoded at 200x150
    d = np.abs(got - ref)
    assert 0 < d.mean() < 2.5 and d.max() <= 24, (d.mean(), d.max())
    asked.clear()
    decode_crops(tmp_path / "big.jpg", 160, 112, 1, decoder="turbo")   # 300 < 2 x 160: no draft
    assert asked == []
    full = decode_crops(tmp_path / "big.jpg", 128, 112, 10, decoder="torchvision").astype(int)
    assert asked == []                      # the default decodes at full size: within a level of PIL
    assert np.abs(full - ref).max() <= 1


def test_errors_are_the_old_ones_under_every_decoder(tmp_path, monkeypatch):
    rgb = photo(40, 30)
    (tmp_path / "zero.jpg").write_bytes(b"")
    (tmp_path / "text.jpg").write_text("not an image at all")
    Image.fromarray(rgb).save(tmp_path / "ok.jpg")
    data = (tmp_path / "ok.jpg").read_bytes()
    (tmp_path / "trunc.jpg").write_bytes(data[: len(data) // 2])
    for name in ("zero.jpg", "text.jpg", "trunc.jpg", "missing.jpg"):
        with pytest.raises(ImageError) as old:
            load_image(tmp_path / name)
        for dec in DECODERS:
            with pytest.raises(ImageError) as new:
                decode_crops(tmp_path / name, 24, 20, 10, decoder=dec)
            assert str(new.value) == str(old.value)
    for dec in DECODERS:
        with pytest.raises(ImageError, match="40x30 is over the decoded pixel budget"):
            decode_crops(tmp_path / "ok.jpg", 24, 20, 1, decoder=dec, max_decoded=1000)
    for dec in DECODERS:
        with pytest.raises(ImageError, match="40x30 resized to 32x24 would be over the resized pixel budget"):
            decode_crops(tmp_path / "ok.jpg", 24, 20, 1, decoder=dec, max_resized=500)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    for dec in DECODERS:
        with pytest.raises(ImageError, match="decompression-bomb"):
            decode_crops(tmp_path / "ok.jpg", 24, 20, 1, decoder=dec)
    monkeypatch.undo()
    with pytest.raises(ImageError, match="crop 30 is larger than the resized image 32x24"):
        decode_crops(tmp_path / "ok.jpg", 24, 30, 1)
    with pytest.raises(ValueError, match="--crops 3"):
        decode_crops(tmp_path / "ok.jpg", 24, 20, 3)
    with pytest.raises(ValueError, match="--decoder 'fast'; valid choices: pil, torchvision, turbo"):
        decode_crops(tmp_path / "ok.jpg", 24, 20, 1, decoder="fast")


def test_a_jpeg_libjpeg_turbo_refuses_is_decoded_by_pil(tmp_path, monkeypatch):
    """Where decode_jpeg raises (or warns of corrupt data), PIL decodes the file: same pixels as before."""
    import warnings

    import torchvision.io

    Image.fromarray(photo(64, 48)).save(tmp_path / "a.jpg", quality=90)
    want = make_crops(load_image(tmp_path / "a.jpg"), 40, 32, 10).transpose(0, 2, 3, 1)
    calls = []

    def refuses(*a, **k):
        calls.append(1)
        raise RuntimeError("Image is incomplete or truncated")

    def warns(*a, **k):
        calls.append(1)
        warnings.warn("Corrupt JPEG data: 2 extraneous bytes before marker")
        return torch_zeros()

    def torch_zeros():
        import torch
        return torch.zeros((3, 48, 64), dtype=torch.uint8)

    for fake in (refuses, warns):
        monkeypatch.setattr(torchvision.io, "decode_jpeg", fake)
        assert np.array_equal(decode_crops(tmp_path / "a.jpg", 40, 32, 10), want)
    assert len(calls) == 2
    # and a file that neither reads: PIL's message
    data = (tmp_path / "a.jpg").read_bytes()
    (tmp_path / "t.jpg").write_bytes(data[:len(data) // 2])
    with pytest.raises(ImageError, match="cannot decode .*t.jpg: image file is truncated"):
        decode_crops(tmp_path / "t.jpg", 40, 32, 10)


def test_decoder_settings_and_provenance():
    assert DEFAULT_DECODER == "torchvision" and UNRECORDED_DECODER == "pil"
    assert {"pil", "torchvision", "turbo"} <= set(DECODERS)
    assert hash_settings("pil") == {} and hash_settings("turbo") == {"decoder": "turbo"}
    assert hash_settings("torchvision") == {"decoder": "torchvision"}
    a = decoder_attrs("turbo")
    assert a["decoder"] == "turbo" and a["draft"] is True and "torch" in a["resize"]
    b = decoder_attrs("torchvision")
    assert b["decoder"] == "torchvision" and b["draft"] is False and "torch" in b["resize"]
    assert decoder_attrs("pil")["draft"] is False and "PIL" in decoder_attrs("pil")["resize"]
    with pytest.raises(ValueError, match="--decoder"):
        decoder_attrs("x")


def test_without_torchvisions_decode_jpeg_the_default_decodes_with_pil_to_the_same_pixels(files, monkeypatch):
    """No torchvision.io (not installed, or its ops do not load): every JPEG is decoded by PIL, whose
    pixels libjpeg-turbo's equal, so the default's crops are the same; the set's provenance says PIL."""
    from vsekit.extract import images

    want = {n: decode_crops(p, 72, 64, 10, decoder=DEFAULT_DECODER) for n, p in files.items()}
    monkeypatch.setattr(images, "_TV", False)   # what _torchvision_io caches when the import fails
    assert images._torchvision_io() is None
    for n, p in files.items():
        assert isinstance(decode_rgb(p), Image.Image), n   # PIL decoded it
        assert np.array_equal(decode_crops(p, 72, 64, 10, decoder=DEFAULT_DECODER), want[n]), n
    a = decoder_attrs(DEFAULT_DECODER)
    assert a["torchvision"] is None and a["decode"].startswith("PIL")


def test_the_default_on_png_and_other_modes_resizes_pils_rgb_with_torch(tmp_path):
    """Non-JPEG files under the default decoder (torchvision): PIL decodes (alpha over white, palette, 16-bit, gray as ever), torch
    resizes. Reference: the known RGB array through torchvision's transforms.v2 resize, numpy crops."""
    import torch
    import torchvision.transforms.v2.functional as F

    rgb = photo(90, 70, 5)
    gray = rgb[..., 1]
    pal = Image.fromarray(rgb).quantize(16)
    cases = {"rgb.png": (Image.fromarray(rgb), rgb),
             "gray.png": (Image.fromarray(gray), np.repeat(gray[..., None], 3, 2)),
             "pal.png": (pal, np.asarray(pal.convert("RGB"))),
             "g16.png": (Image.fromarray(gray.astype(np.uint16) * 257), np.repeat(gray[..., None], 3, 2)),
             "rgba.png": (Image.fromarray(np.dstack([rgb, np.full(gray.shape, 255, np.uint8)])), rgb),
             "rgb.bmp": (Image.fromarray(rgb), rgb)}
    for name, (img, known) in cases.items():
        img.save(tmp_path / name)
        ref = F.resize(torch.from_numpy(np.ascontiguousarray(known)).permute(2, 0, 1), [40], antialias=True)
        want = numpy_crops(ref.permute(1, 2, 0).numpy(), 32, 10)
        got = decode_crops(tmp_path / name, 40, 32, 10, decoder=DEFAULT_DECODER)
        assert np.array_equal(got, want), name


@pytest.mark.parametrize("size,decoder,bounds", [
    # COCO / Flickr30K-sized photos at resize 256: no DCT scaling (under 2x 341x256); measured max 1,
    # mean 0.008, features 3.1e-5
    ((640, 480), "turbo", {"max": 1, "mean": 0.02, "features": 1e-4}),
    ((640, 480), "torchvision", {"max": 1, "mean": 0.02, "features": 1e-4}),
    # larger photos: turbo decodes them at 1/2 by DCT scaling, then resizes; measured max 6, mean 0.94,
    # features 0.0097; the default decodes them in full (one level, as at 640x480)
    ((1024, 768), "turbo", {"max": 12, "mean": 2.0, "features": 0.03}),
    ((1024, 768), "torchvision", {"max": 1, "mean": 0.02, "features": 1e-4}),
])
def test_pil_and_the_others_differ_by_the_documented_bounds(tmp_path, size, decoder, bounds):
    """The pixel difference docs/extract.md quotes: photo-like JPEGs (quality 90), resize 256, 10
    crops of 224, bilinear: max and mean absolute difference of the crops (0-255 levels), and the
    relative difference ||f_pil - f_turbo|| / ||f_pil|| of a random-weight model's mean features
    (test_resnet, weights none), in float64."""
    import torch

    from vsekit.extract.extractor import Extractor
    from vsekit.extract.plan import make_plan

    w, h = size
    paths = []
    for i in range(3):
        p = tmp_path / f"{i}.jpg"
        Image.fromarray(photo(w, h, 20 + i)).save(p, quality=90)
        paths.append(p)
    a = np.stack([decode_crops(p, 256, 224, 10, decoder="pil") for p in paths])
    b = np.stack([decode_crops(p, 256, 224, 10, decoder=decoder) for p in paths])
    d = np.abs(a.astype(np.int16) - b)
    assert 0 < d.max() <= bounds["max"] and d.mean() < bounds["mean"], (d.max(), d.mean())
    ex = Extractor(make_plan("test_resnet", "global", weights="none", crops=10, resize=256, input_size=224))
    fa = ex.features(torch.from_numpy(a)).astype(np.float64)
    fb = ex.features(torch.from_numpy(b)).astype(np.float64)
    rel = np.linalg.norm(fa - fb, axis=1) / np.linalg.norm(fa, axis=1)
    assert rel.max() < bounds["features"], rel
