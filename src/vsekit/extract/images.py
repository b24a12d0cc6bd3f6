"""Decoding images to RGB and cutting the crops of the papers' protocol.

Every valid image mode becomes 8-bit RGB: EXIF orientation applied, grayscale replicated, 16-bit
scaled to 8 bits, CMYK and palette converted, alpha composited over white. Crops follow the usual
10-crop protocol (Krizhevsky et al.; used by the FNE and SEAM papers): resize (shorter side to
``resize``, or ``resize``×``resize`` in square mode as in the FNE paper's 256×256), then the centre
crop, or the 4 corners + centre, or those 5 and their horizontal mirrors.

Decoders (``DECODERS``: ``pil``, ``torchvision``, the default, ``turbo``, ``nvjpeg``): what each decodes
and resizes with, and how far their features are from ``pil``'s, is docs/extract.md, "Decoders". The
decoding workers call :func:`decode_crops`, which returns the crops NHWC so that no transpose is paid on
the host. A baseline RGB or L JPEG is decoded by libjpeg-turbo through ``torchvision.io.decode_jpeg``
(the library PIL uses: PIL's pixels, ~30% less CPU); any other file, and any JPEG it refuses, by PIL, so
every error message is PIL's; without a loadable ``decode_jpeg``, by PIL (the same pixels, more CPU; the
set's ``decoding`` attrs say so). A decoder other than ``pil`` changes pixels, so it is part of a
feature set's settings (:func:`hash_settings`).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

INTERPOLATIONS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
                  "nearest": Image.Resampling.NEAREST, "lanczos": Image.Resampling.LANCZOS}
CROP_CHOICES = (1, 5, 10)
RESIZE_MODES = ("shorter", "square")


MAX_RESIZED_PIXELS = 16_000_000  # 48 MB of RGB: a 250:1 panorama at --resize 256 still fits


from ..storage.base import ImageError  # noqa: E402,F401 (its home is storage; readers there raise it)


def pixel_budgets(max_decoded: int | None = None, max_resized: int | None = None) -> tuple[int, int]:
    """(decoded, resized) pixel budgets: an image over either is failed before it takes memory.

    Decoded: ``max_decoded`` (``--max-decoded-pixels``), else PIL's decompression-bomb limit
    ``Image.MAX_IMAGE_PIXELS`` (about 89.5 Mpx); it counts 8-bit pixels, so an image of 16-bit
    samples counts double (:func:`decoded_cost`). Resized: ``max_resized`` (``--max-resized-pixels``),
    else ``MAX_RESIZED_PIXELS`` (16 Mpx). The second one matters for thin images: a 20000×2 PNG is
    40 kpx decoded, but its shorter side resized to 256 would be 2,560,000×256 (655 Mpx, ~2 GB).
    Both decide which rows fail, so they are extraction options recorded with the set (extract/plan.py).
    """
    return (int(max_decoded or Image.MAX_IMAGE_PIXELS or 2 ** 62), int(max_resized or MAX_RESIZED_PIXELS))


#: Bytes per sample of the PIL modes wider than 8 bits; every other mode counts 1.
WIDE_MODES = {"I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2, "I": 4, "F": 4}


def decoded_cost(size: tuple[int, int], mode: str) -> int:
    """What an image counts against the decoded pixel budget: its pixels times the bytes of one
    sample, so the budget bounds decoded bytes (a 16-bit PNG counts double, a 32-bit one four times)."""
    return int(size[0]) * int(size[1]) * WIDE_MODES.get(mode, 1)


def load_image(path: str | Path, max_decoded: int | None = None, data: bytes | None = None) -> Image.Image:
    """Open ``path`` as an 8-bit RGB image, EXIF-rotated; raise ImageError on bad input (and on an
    image over the decoded pixel budget, :func:`pixel_budgets`). ``path`` may also name an image inside
    a shard (``shard.tar::key.jpg``, a parquet row; :mod:`vsekit.storage.sources.shards`) or on object
    storage; ``data``: its bytes, fetched already."""
    from ..storage.sources import remote

    data = remote.image_bytes(str(path)) if data is None else data   # None: a local file, opened by PIL
    return _decode(Path(path) if data is None else str(path), None, None, "shorter", False, max_decoded, data=data)[0]


load_ref_image = load_image   # the name the report and older callers use for shard references


def _decode(path: Path, decoder: str | None, resize_to: int | None, resize_mode: str, fast_jpeg: bool,
            max_decoded: int | None = None, data: bytes | None = None):
    """(RGB image, its EXIF-rotated full size): a PIL image, or an HWC uint8 array where
    libjpeg-turbo decoded it (``fast_jpeg``). ``decoder="turbo"`` with ``resize_to`` decodes a JPEG
    at least twice the resize with DCT scaling (``Image.draft``); then the image is smaller than the
    size returned with it. ``data``: the file's bytes, read already (an image inside a shard)."""
    if data is None:
        if not path.exists():
            raise ImageError(f"missing file {path}")
        if path.stat().st_size == 0:
            raise ImageError(f"empty (zero-byte) file {path}")
    elif not data:
        raise ImageError(f"empty (zero-byte) image {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path if data is None else io.BytesIO(data)) as img:
                budget = pixel_budgets(max_decoded)[0]
                cost = decoded_cost(img.size, img.mode)
                if cost > budget:  # from the header, before any pixel is decoded
                    wide = f" x {cost // (img.size[0] * img.size[1])} bytes per sample ({img.mode})" \
                        if cost > img.size[0] * img.size[1] else ""
                    raise ImageError(f"image {img.size[0]}x{img.size[1]}{wide} is over the decoded pixel budget "
                                     f"({budget} pixels of 8 bits, PIL's decompression-bomb limit or "
                                     f"--max-decoded-pixels): {path}")
                full, drafted = img.size, False
                if fast_jpeg and img.format == "JPEG" and img.mode in ("RGB", "L"):
                    orientation = img.getexif().get(0x0112, 1)
                    if orientation in (5, 6, 7, 8):
                        full = full[::-1]
                    draft = None
                    if decoder == "turbo" and resize_to:
                        draft = _draft_size(img.size, orientation, resized_size(*full, resize_to, resize_mode))
                    if draft is not None:
                        drafted = img.draft(img.mode, draft) is not None
                    else:
                        a = _turbo_jpeg(path if data is None else data, img.mode)
                        if a is not None:
                            return oriented(a, orientation), full
                img.load()
                img = ImageOps.exif_transpose(img)
                if not drafted:
                    full = img.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"image over PIL's decompression-bomb limit ({Image.MAX_IMAGE_PIXELS} "
                         f"pixels): {path} ({exc})") from None
    except Image.UnidentifiedImageError:
        raise ImageError(f"not an image file PIL can read: {path}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"cannot decode {path}: {exc}") from None
    return to_rgb(img), full


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


def budgeted_size(w: int, h: int, size: int, mode: str = "shorter", max_resized: int | None = None) -> tuple[int, int]:
    """:func:`resized_size`, or ImageError where it is over the resized pixel budget (nothing resized)."""
    new = resized_size(w, h, size, mode)
    budget = pixel_budgets(max_resized=max_resized)[1]
    if new[0] * new[1] > budget:
        raise ImageError(f"image {w}x{h} resized to {new[0]}x{new[1]} would be over the resized pixel "
                         f"budget ({budget} pixels, --max-resized-pixels); not resized")
    return new


def resize(img: Image.Image, size: int, mode: str = "shorter", interpolation: str = "bilinear",
           max_resized: int | None = None) -> Image.Image:
    """Resize as torchvision's ``T.Resize`` on a PIL image (same size, same PIL filter).

    Raises ImageError, before resizing, if the result would exceed the resized pixel budget.
    """
    new = budgeted_size(*img.size, size, mode, max_resized)
    if new == img.size:
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
    """uint8 array (n_crops, 3, crop, crop): crops [0:5] as in crop_boxes, [5:10] their mirrors.

    The CHW layout of the old reader; :func:`image_crops` gives the same crops NHWC without the
    transpose.
    """
    return np.ascontiguousarray(image_crops(img, resize_to, crop, n_crops, resize_mode, interpolation)
                                .transpose(0, 3, 1, 2))


# --- decoders --------------------------------------------------------------------------------------------
DECODERS = ("pil", "torchvision", "turbo", "nvjpeg")
#: the decoder of a new feature set made without ``--decoder``: a full-size decode (issue 47: turbo's
#: DCT scaling moved features by up to 8e-2 on large JPEGs)
DEFAULT_DECODER = "torchvision"
#: the decoders that resize with torch (``pil`` resizes with PIL)
TORCH_DECODERS = ("torchvision", "turbo", "nvjpeg")
#: the decoder of a set whose settings name none: every set made before ``turbo`` became the default
#: (``hash_settings("pil")`` is empty, so such sets keep their settings hash), and every regions set
UNRECORDED_DECODER = "pil"
#: torch's antialiased uint8 resize covers these; the others stay PIL's under every decoder
TORCH_RESIZE = {"bilinear": "bilinear", "bicubic": "bicubic"}


def check_decoder(name: str) -> str:
    if name not in DECODERS:
        raise ValueError(f"--decoder {name!r}; valid choices: {', '.join(DECODERS)}")
    return name


def decoder_attrs(name: str) -> dict:
    """Provenance of a decoder choice, for a feature set's attrs.

    ``{"decoder": name}`` is what changes pixels and belongs in the settings hash; put it there only
    for a decoder other than ``"pil"`` so that sets made before decoders existed (all ``"pil"``) keep
    their hash. The other keys (``decode``, ``resize``, ``draft``, library versions) describe it
    and stay outside the hash: a torchvision upgrade must not orphan a set.
    """
    check_decoder(name)
    import PIL

    tv = _torchvision_io()
    cpu = "JPEG (RGB/L): libjpeg-turbo via torchvision.io.decode_jpeg, bit-equal to PIL's; other files: PIL"
    return {"decoder": name, "pillow": PIL.__version__, "draft": name == "turbo",
            "decode": ("JPEG (RGB/L): nvjpeg via torchvision.io.decode_jpeg(device='cuda'), batched; "
                       "other files: as torchvision") if name == "nvjpeg" else cpu if tv is not None else
                      "PIL (torchvision.io.decode_jpeg does not load here; the same pixels, more CPU)",
            "resize": "PIL (as T.Resize on a PIL image)" if name == "pil" else
                      "torch uint8 antialiased interpolate (bilinear/bicubic; nearest/lanczos: PIL)",
            "torchvision": getattr(tv, "__version__", None) if tv is not None else None}


def hash_settings(name: str) -> dict:
    """The part of the settings hash that a decoder contributes: nothing for ``"pil"`` (old sets keep
    their hash), ``{"decoder": name}`` otherwise."""
    return {} if check_decoder(name) == "pil" else {"decoder": name}


_TV = None


def _torchvision_io():
    """``torchvision`` if its image ops load here (decode_jpeg), else None: then PIL decodes."""
    global _TV
    if _TV is None:
        try:
            import torchvision
            from torchvision.io import decode_jpeg  # noqa: F401

            _TV = torchvision
        except Exception:   # no torchvision, or its compiled ops do not load
            _TV = False
    return _TV or None


#: EXIF orientation → (swap the two axes first, then the axes to flip): PIL's ImageOps.exif_transpose
_ORIENT = {2: (False, (1,)), 3: (False, (0, 1)), 4: (False, (0,)), 5: (True, ()), 6: (True, (1,)),
           7: (True, (0, 1)), 8: (True, (0,))}


def oriented(hwc, orientation: int):
    """An HWC image (numpy array or tensor, CPU or GPU) oriented as PIL's ``ImageOps.exif_transpose``
    orients it for EXIF ``orientation`` (a view where numpy makes one)."""
    swap, flips = _ORIENT.get(orientation, (False, ()))
    hwc = hwc.swapaxes(0, 1) if swap else hwc
    if not flips:
        return hwc
    return np.flip(hwc, flips) if isinstance(hwc, np.ndarray) else hwc.flip(flips)


def _turbo_jpeg(src: "Path | bytes", mode: str) -> np.ndarray | None:
    """An RGB/L JPEG (a file, or its bytes) decoded by torchvision's libjpeg-turbo as HWC uint8, or
    None (PIL then decodes it and says what is wrong: decode_jpeg refuses truncated files that PIL
    reads, never the reverse)."""
    tv = _torchvision_io()
    if tv is None:
        return None
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # a corrupt-data warning: PIL decodes it (or says why not)
            warnings.simplefilter("ignore", DeprecationWarning)   # torchvision 0.29: "use torchcodec"
            raw = read_file(str(src)) if isinstance(src, Path) else torch.frombuffer(bytearray(src), dtype=torch.uint8)
            out = decode_jpeg(raw, mode=ImageReadMode.UNCHANGED)
    except Exception:
        return None
    a = out.permute(1, 2, 0).numpy()   # decode_jpeg's CHW is a view of HWC memory: no copy
    if a.shape[2] == 1 and mode == "L":
        return np.repeat(a, 3, axis=2)
    if a.shape[2] != 3 or mode != "RGB":
        return None
    return a


def _draft_size(size: tuple[int, int], orientation: int, target: tuple[int, int]) -> tuple[int, int] | None:
    """The size to ask ``Image.draft`` for (stored orientation), or None where the image is not at
    least twice ``target`` (oriented) in both sides (then DCT scaling would not apply)."""
    tw, th = (target[1], target[0]) if orientation in (5, 6, 7, 8) else target
    if size[0] >= 2 * tw and size[1] >= 2 * th:
        return tw, th
    return None


def _size(img) -> tuple[int, int]:
    return img.size if isinstance(img, Image.Image) else (int(img.shape[1]), int(img.shape[0]))


def _resized_hwc(img, size: int, mode: str, interpolation: str, decoder: str, full: tuple[int, int] | None = None,
                 max_resized: int | None = None):
    """HWC uint8 (numpy) of ``img`` (PIL image or HWC array) resized as ``resize`` says; ``full``:
    the image's size before DCT scaling, for the budget and the target size."""
    new = budgeted_size(*(full or _size(img)), size, mode, max_resized)
    if new == _size(img):
        return np.asarray(img, dtype=np.uint8)
    if decoder in TORCH_DECODERS and interpolation in TORCH_RESIZE:
        import torch

        with warnings.catch_warnings():   # PIL's arrays are read-only; interpolate only reads them
            warnings.simplefilter("ignore", UserWarning)
            hwc = torch.from_numpy(np.ascontiguousarray(np.asarray(img, dtype=np.uint8)))
        return torch_resize(hwc, new, interpolation).numpy()
    if not isinstance(img, Image.Image):
        img = Image.fromarray(np.ascontiguousarray(img), "RGB")
    return np.asarray(img.resize(new, INTERPOLATIONS[interpolation]), dtype=np.uint8)


def torch_resize(hwc, new: tuple[int, int], interpolation: str):
    """HWC uint8 tensor (CPU or GPU) → HWC uint8 tensor of size ``new`` (w, h): torch's antialiased
    uint8 interpolate, what ``transforms.v2`` does on decoded tensors."""
    import torch

    # (1, H, W, 3) permuted: channels-last NCHW whose batch stride is the numel, so that interpolate's
    # output stays channels-last (HWC again, no copy); a [None] after the permute would give a batch
    # stride of 3 and a planar output
    t = hwc.contiguous()[None].permute(0, 3, 1, 2)
    with torch.no_grad():
        out = torch.nn.functional.interpolate(t, size=(new[1], new[0]), mode=TORCH_RESIZE[interpolation],
                                              antialias=True, align_corners=False)
    return out[0].permute(1, 2, 0)


def cut(hwc, crop: int, n_crops: int):
    """(n_crops, crop, crop, 3) uint8 of an HWC image (numpy array, or a tensor on any device, which
    gives a tensor): the crops of crop_boxes, then their mirrors (torch.flip: numpy copies 3-byte
    pixels backwards ~10x slower)."""
    import torch

    with warnings.catch_warnings():   # PIL's arrays are read-only; the crops only read them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.ascontiguousarray(hwc)) if isinstance(hwc, np.ndarray) else hwc
    corners = crop_boxes(int(t.shape[1]), int(t.shape[0]), crop, n_crops)
    out = t.new_empty((n_crops, crop, crop, 3))
    for i, (x, y) in enumerate(corners):
        out[i] = t[y:y + crop, x:x + crop]
    if n_crops == 10:
        out[5:] = torch.flip(out[:5], dims=(2,))
    return out.numpy() if isinstance(hwc, np.ndarray) else out


def image_crops(img, resize_to: int, crop: int, n_crops: int, resize_mode: str = "shorter",
                interpolation: str = "bilinear", decoder: str = UNRECORDED_DECODER,
                max_resized: int | None = None) -> np.ndarray:
    """uint8 (n_crops, crop, crop, 3) of a decoded RGB image (PIL image or HWC uint8 array)."""
    check_decoder(decoder)
    return cut(_resized_hwc(img, resize_to, resize_mode, interpolation, decoder, max_resized=max_resized),
                crop, n_crops)


def decode_crops(path: str | Path, resize_to: int, crop: int, n_crops: int, resize_mode: str = "shorter",
                 interpolation: str = "bilinear", decoder: str = UNRECORDED_DECODER,
                 max_decoded: int | None = None, max_resized: int | None = None,
                 data: bytes | None = None) -> np.ndarray:
    """The decoding worker's whole job for one image file, or one image inside a shard
    (``shard.tar::key.jpg``, a parquet row; :mod:`vsekit.storage.sources.shards`): decode → resize → crops.

    Returns uint8 ``(n_crops, crop, crop, 3)`` (NHWC), crops [0:5] as in crop_boxes and [5:10] their
    mirrors; with ``decoder="pil"`` equal to ``make_crops(load_image(path), ...)`` transposed to NHWC.
    Raises ImageError / ValueError with load_image's and resize's messages. An image inside a shard or
    on object storage (``data``: its bytes, fetched already) is decoded as the same file unpacked on
    disk (so a set's pixels do not depend on where it lies).
    """
    from ..storage.sources import remote

    if n_crops not in CROP_CHOICES:
        raise ValueError(f"--crops {n_crops}; valid choices: 1, 5, 10")
    data = remote.image_bytes(str(path)) if data is None else data   # None: a local file, opened by PIL
    img, full = _decode(Path(path) if data is None else str(path), check_decoder(decoder), resize_to, resize_mode, True, max_decoded, data=data)
    return cut(_resized_hwc(img, resize_to, resize_mode, interpolation, decoder, full, max_resized), crop, n_crops)
