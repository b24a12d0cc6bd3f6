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
