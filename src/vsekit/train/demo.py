"""Cheap deterministic image features for demos and tests: no CNN, just the pixels.

``pixel_features`` writes a ``global`` feature set whose rows are each image downsampled to
``side x side`` RGB (area averaging), centred, plus a coarse colour histogram. On the synthetic demo
data (coloured shapes at named positions) this carries what the captions describe, so a retrieval
model can learn from it in seconds; real runs use ``vsekit extract``.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from ..storage.store import FeatureStore


def pixel_vector(path, side: int = 8, bins: int = 4) -> np.ndarray:
    with Image.open(path) as im:
        im = im.convert("RGB")
        small = np.asarray(im.resize((side, side), Image.BOX), dtype=np.float32) / 255.0
        q = (np.asarray(im.resize((32, 32), Image.BOX)) // (256 // bins)).reshape(-1, 3)
    hist = np.bincount(q[:, 0] * bins * bins + q[:, 1] * bins + q[:, 2], minlength=bins ** 3)
    return np.concatenate([small.ravel() - 0.5, hist.astype(np.float32) / len(q)])


def pixel_features(store: FeatureStore, name: str = "pixels", side: int = 8, bins: int = 4,
                   block_rows: int | None = None, dtype: str = "float32"):
    """Write (or complete) the feature set ``name`` of pixel vectors for every image of ``store``."""
    dim = side * side * 3 + bins ** 3
    fs = store.create_features(name, (dim,), dtype, block_rows=block_rows,
                               attrs={"kind": "global", "model": "pixels", "weights": "none", "crops": 1,
                                      "resize": side, "resize_mode": "box", "precision": dtype,
                                      "side": side, "bins": bins})
    for block in fs.pending_blocks():
        rows = range(block.start, block.stop)
        fs.write_block(block, np.stack([pixel_vector(store.image_file(r), side, bins) for r in rows]))
    return fs
