"""Thumbnails and attention heat maps, inlined in the page as base64 JPEG/PNG data URIs.

Only the images shown are read, each once per report (cached by path), so the cost does not depend
on the test-set size. An image no longer on disk gives ``None`` and the page shows a placeholder
naming the missing file.
"""

from __future__ import annotations

import base64
import io
from functools import lru_cache
from pathlib import Path

import numpy as np

# a perceptual "inferno"-like ramp: (position, r, g, b)
_RAMP = np.array([(0.00, 0, 0, 4), (0.25, 87, 16, 110), (0.50, 188, 55, 84), (0.75, 249, 142, 9),
                  (1.00, 252, 255, 164)], dtype=np.float64)


def colormap(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] → uint8 RGB (..., 3) on the heat ramp."""
    v = np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0)
    rgb = [np.interp(v, _RAMP[:, 0], _RAMP[:, c]) for c in (1, 2, 3)]
    return np.stack(rgb, axis=-1).round().astype(np.uint8)


def heat_rgb(weight: float) -> str:
    """A CSS colour for a weight in [0, 1] (used by the word heat strips)."""
    r, g, b = colormap(np.asarray(weight))
    return f"rgb({r},{g},{b})"


def _data_uri(img, fmt: str = "JPEG") -> str:
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.convert("RGB").save(buf, format="JPEG", quality=82)
        mime = "image/jpeg"
    else:
        img.save(buf, format="PNG")
        mime = "image/png"
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@lru_cache(maxsize=512)
def _open_rgb(path: str, size: int):
    from PIL import Image

    from ..extract.images import load_ref_image
    from ..storage.sources import remote, shards

    # an image inside a tar shard or parquet file (ingest webdataset|parquet), or on object storage
    # (fetched with this command's --storage-option / --image-option)
    if shards.is_ref(path) or remote.is_url(path):
        try:
            im = load_ref_image(path)
        except Exception as exc:
            raise OSError(str(exc)) from None
        im.thumbnail((size, size))
        return im
    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail((size, size))
        return im.copy()


def load_thumbnail(path: str | Path, size: int = 128):
    """A PIL thumbnail of ``path`` (longest side ``size``), or None when it cannot be read."""
    try:
        return _open_rgb(str(path), int(size))
    except (OSError, ValueError):
        return None


def thumbnail_uri(path: str | Path, size: int = 128) -> str | None:
    img = load_thumbnail(path, size)
    return None if img is None else _data_uri(img)


def heatmap_uri(weights: np.ndarray, path: str | Path | None, size: int = 160, alpha: float = 0.55) -> str:
    """A (G, G) attention map drawn over the image at ``path`` (or alone if it is missing)."""
    from PIL import Image

    w = np.asarray(weights, dtype=np.float64)
    span = w.max() - w.min()
    w = (w - w.min()) / span if span > 0 else np.zeros_like(w)
    heat = Image.fromarray(colormap(w), "RGB")
    base = load_thumbnail(path, size) if path is not None else None
    if base is None:
        return _data_uri(heat.resize((size, size), Image.NEAREST), "PNG")
    if max(base.size) < size:  # small images: enlarge so the map is readable
        scale = size / max(base.size)
        base = base.resize((round(base.size[0] * scale), round(base.size[1] * scale)), Image.BICUBIC)
    heat = heat.resize(base.size, Image.BILINEAR)
    return _data_uri(Image.blend(base, heat, alpha))
