"""Region boxes drawn over their image, with the detector's labels: a check that a regions feature
set (``--kind regions``; ``--detector butd-r101`` also stores object and attribute labels) looks
right, as the bottom-up-attention demo draws "attribute object" over each box.

Labels are 0-based indices into the 1,600 object / 400 attribute vocabularies of the BUTD model
(``data/genome/1600-400-20/objects_vocab.txt`` and ``attributes_vocab.txt`` of
peteanderson80/bottom-up-attention; a line is ``name[,synonym...]``, the first name is shown).
Without the vocabulary files the indices are shown (``obj 12``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

PALETTE = [(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180), (70, 240, 240),
           (240, 50, 230), (210, 245, 60), (250, 190, 190), (0, 128, 128), (170, 110, 40), (255, 225, 25)]


def read_vocab(path: str | Path | None) -> list[str] | None:
    """The first name of each line of a BUTD vocabulary file, lower-cased (None without a file)."""
    if path is None:
        return None
    return [line.split(",")[0].strip().lower() for line in Path(path).read_text().splitlines() if line.strip()]


def box_captions(labels: np.ndarray | None, attrs: np.ndarray | None, objects: Sequence[str] | None = None,
                 attributes: Sequence[str] | None = None) -> list[str] | None:
    """"attribute object" per box (names from the vocabularies, else the indices)."""
    if labels is None:
        return None

    def name(vocab, i, what):
        return vocab[i] if vocab is not None and 0 <= i < len(vocab) else f"{what} {i}"

    out = []
    for k, lab in enumerate(labels):
        obj = name(objects, int(lab), "obj")
        out.append(obj if attrs is None else f"{name(attributes, int(attrs[k]), 'attr')} {obj}")
    return out


def draw_boxes(image, boxes: np.ndarray, captions: Sequence[str] | None = None):
    """A copy of the PIL ``image`` with ``boxes`` (K, 4; x1 y1 x2 y2 in its pixels) outlined and captioned."""
    from PIL import ImageDraw

    img = image.convert("RGB").copy()
    draw = ImageDraw.Draw(img)
    width = max(1, round(min(img.size) / 200))
    for k, (x1, y1, x2, y2) in enumerate(np.asarray(boxes, dtype=np.float64).reshape(-1, 4)):
        colour = PALETTE[k % len(PALETTE)]
        draw.rectangle([x1, y1, x2, y2], outline=colour, width=width)
        if captions:
            text = captions[k]
            left, top, right, bottom = draw.textbbox((x1, y1), text)
            draw.rectangle([left, top, right + 2, bottom + 1], fill=colour)
            draw.text((x1 + 1, y1), text, fill=(255, 255, 255))
    return img


def regions_png(store, name: str, row: int, out: str | Path, *, objects_vocab: str | Path | None = None,
                attributes_vocab: str | Path | None = None, max_boxes: int | None = None) -> Path:
    """Write the image of ``row`` with the boxes (and labels, if stored) of regions set ``name``; an
    image on object storage is fetched with this process's --image-option / --storage-option."""
    from ..extract.reader import decode
    from ..storage.store import FeatureStore, StoreError

    store = store if isinstance(store, FeatureStore) else FeatureStore.open(store)
    fs = store.features(name)
    if fs.attrs.get("kind") != "regions" or not fs.has_array("boxes"):
        raise StoreError(f"feature set {name!r} in {store.path} has no region boxes (kind {fs.attrs.get('kind')!r})")
    if not 0 <= row < fs.n_rows:
        raise StoreError(f"row {row} is outside feature set {name!r} (0..{fs.n_rows - 1})")
    k = int(fs.array("count")[row])
    k = k if max_boxes is None else min(k, int(max_boxes))
    boxes = fs.array("boxes")[row, :k]
    labels = fs.array("labels")[row, :k] if fs.has_array("labels") else None
    attrs = fs.array("attrs")[row, :k] if fs.has_array("attrs") else None
    captions = box_captions(labels, attrs, read_vocab(objects_vocab), read_vocab(attributes_vocab))
    img = draw_boxes(decode(str(store.image_file(row))), boxes, captions)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out, format="PNG")
    return out
