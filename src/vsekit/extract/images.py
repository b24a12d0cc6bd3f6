"""Decoding images to RGB and cutting the crops of the papers' protocol.

Every valid image mode becomes 8-bit RGB: EXIF orientation applied, grayscale replicated, 16-bit
scaled to 8 bits, CMYK and palette converted, alpha composited over white. Crops follow the usual
10-crop protocol (Krizhevsky et al.; used by the FNE and SEAM papers): resize (shorter side to
``resize``, or ``resize``×``resize`` in square mode as in the FNE paper's 256×256), then the centre
crop, or the 4 corners + centre, or those 5 and their horizontal mirrors.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

INTERPOLATIONS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
                  "nearest": Image.Resampling.NEAREST, "lanczos": Image.Resampling.LANCZOS}
CROP_CHOICES = (1, 5, 10)
RESIZE_MODES = ("shorter", "square")


MAX_RESIZED_PIXELS = 16_000_000  # 48 MB of RGB: a 250:1 panorama at --resize 256 still fits
ENV_DECODED, ENV_RESIZED = "VSEKIT_MAX_DECODED_PIXELS", "VSEKIT_MAX_RESIZED_PIXELS"


from ..storage.base import ImageError  # noqa: E402,F401 (its home is storage; readers there raise it)


def pixel_budgets() -> tuple[int, int]:
    """(decoded, resized) pixel budgets: an image over either is failed before it takes memory.

    Decoded: PIL's decompression-bomb limit ``Image.MAX_IMAGE_PIXELS`` (about 89.5 Mpx) unless
    ``$VSEKIT_MAX_DECODED_PIXELS`` says otherwise; it counts 8-bit pixels, so an image of 16-bit
    samples counts double (:func:`decoded_cost`). Resized: ``MAX_RESIZED_PIXELS`` (16 Mpx) unless
    ``$VSEKIT_MAX_RESIZED_PIXELS``. The second one matters for thin images: a 20000×2 PNG is 40 kpx
    decoded, but its shorter side resized to 256 would be 2,560,000×256 (655 Mpx, ~2 GB).
    """
    import os

    def env(name, default):
        raw = os.environ.get(name, "").strip()
        if not raw:
            return int(default)
        try:
            value = int(float(raw))
        except ValueError:
            raise ValueError(f"${name}={raw!r}: expected a number of pixels") from None
        if value <= 0:
            raise ValueError(f"${name}={raw!r}: must be > 0")
        return value

    return env(ENV_DECODED, Image.MAX_IMAGE_PIXELS or 2 ** 62), env(ENV_RESIZED, MAX_RESIZED_PIXELS)


#: Bytes per sample of the PIL modes wider than 8 bits; every other mode counts 1.
WIDE_MODES = {"I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2, "I": 4, "F": 4}


def decoded_cost(size: tuple[int, int], mode: str) -> int:
    """What an image counts against the decoded pixel budget: its pixels times the bytes of one
    sample, so the budget bounds decoded bytes (a 16-bit PNG counts double, a 32-bit one four times)."""
    return int(size[0]) * int(size[1]) * WIDE_MODES.get(mode, 1)


def load_image(path: str | Path) -> Image.Image:
    """Open ``path`` as an 8-bit RGB image, EXIF-rotated; raise ImageError on bad input."""
    path = Path(path)
    if not path.exists():
        raise ImageError(f"missing file {path}")
    if path.stat().st_size == 0:
        raise ImageError(f"empty (zero-byte) file {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                budget = pixel_budgets()[0]
                cost = decoded_cost(img.size, img.mode)
                if cost > budget:  # from the header, before any pixel is decoded
                    wide = f" x {cost // (img.size[0] * img.size[1])} bytes per sample ({img.mode})" \
                        if cost > img.size[0] * img.size[1] else ""
                    raise ImageError(f"image {img.size[0]}x{img.size[1]}{wide} is over the decoded pixel budget "
                                     f"({budget} pixels of 8 bits, PIL's decompression-bomb limit or "
                                     f"${ENV_DECODED}): {path}")
                img.load()
                img = ImageOps.exif_transpose(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image over PIL's decompression-bomb limit ({Image.MAX_IMAGE_PIXELS} "
                         f"pixels): {path} ({exc})") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"not an image file PIL can read: {path}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"cannot decode {path}: {exc}") from None
    return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any PIL mode → 8-bit RGB (alpha over white, 16/32-bit scaled, CMYK/palette converted)."""
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16"):   # integer rint(a / 257): 4 bytes a pixel, not float64's 8 (and its temporaries)
        b = np.asarray(img).astype(np.uint32)
        b *= 2
        b += 257
        b //= 514
        return Image.fromarray(b.astype(np.uint8), "L").convert("RGB")
    if mode in ("I", "F"):
        a = np.asarray(img, dtype=np.float64)
        if mode != "F":
            a = a / 257.0 if mode.startswith("I;16") or a.max() > 255 else a
            if mode == "I" and a.max() > 255:  # 32-bit data beyond 16 bits
                a = a / (a.max() / 255.0)
        else:
            a = a * 255.0 if a.max() <= 1.0 else a
        a = np.clip(np.rint(a), 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def resized_size(width: int, height: int, size: int, mode: str = "shorter") -> tuple[int, int]:
    """(width, height) after the resize, as torchvision's ``T.Resize(size)`` computes it.

    Shorter mode: the shorter side becomes ``size`` and the longer one ``int(size * long / short)``
    (truncated, as torchvision and timm do, not rounded). Square mode: ``size`` × ``size``.
    """
    if mode not in RESIZE_MODES:
        raise ValueError(f"--resize-mode {mode!r}; valid choices: {', '.join(RESIZE_MODES)}")
    if mode == "square":
        return size, size
    if width <= height:
        return size, max(1, int(size * height / width))
    return max(1, int(size * width / height)), size


def resize(img: Image.Image, size: int, mode: str = "shorter", interpolation: str = "bilinear") -> Image.Image:
    """Resize as torchvision's ``T.Resize`` on a PIL image (same size, same PIL filter).

    Raises ImageError, before resizing, if the result would exceed the resized pixel budget.
    """
    w, h = img.size
    new = resized_size(w, h, size, mode)
    budget = pixel_budgets()[1]
    if new[0] * new[1] > budget:
        raise ImageError(f"image {w}x{h} resized to {new[0]}x{new[1]} would be over the resized pixel "
                         f"budget ({budget} pixels, ${ENV_RESIZED}); not resized")
    if new == (w, h):
        return img
    return img.resize(new, INTERPOLATIONS[interpolation])


def crop_boxes(width: int, height: int, crop: int, n_crops: int) -> list[tuple[int, int]]:
    """Top-left corners of the centre crop, or of the 4 corners + centre (in that order)."""
    if n_crops not in CROP_CHOICES:
        raise ValueError(f"--crops {n_crops}; valid choices: 1, 5, 10")
    if crop > width or crop > height:
        raise ImageError(f"crop {crop} is larger than the resized image {width}x{height}")
    cx, cy = int(round((width - crop) / 2.0)), int(round((height - crop) / 2.0))
    if n_crops == 1:
        return [(cx, cy)]
    return [(0, 0), (width - crop, 0), (0, height - crop), (width - crop, height - crop), (cx, cy)]


def make_crops(img: Image.Image, resize_to: int, crop: int, n_crops: int, resize_mode: str = "shorter",
               interpolation: str = "bilinear") -> np.ndarray:
    """uint8 array (n_crops, 3, crop, crop): crops [0:5] as in crop_boxes, [5:10] their mirrors."""
    img = resize(img, resize_to, resize_mode, interpolation)
    a = np.asarray(img, dtype=np.uint8)
    corners = crop_boxes(img.size[0], img.size[1], crop, n_crops)
    out = [a[y:y + crop, x:x + crop] for x, y in corners]
    if n_crops == 10:
        out += [c[:, ::-1] for c in out]
    return np.ascontiguousarray(np.stack(out).transpose(0, 3, 1, 2))
