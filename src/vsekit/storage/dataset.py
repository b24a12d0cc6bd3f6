"""A store's dataset: its images (ids, paths, splits) and captions, read and written by
:class:`~.store.FeatureStore` through :class:`DatasetRows`, and the writers of whole small arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import zarr

from .base import StoreError
from .meta import SPLIT_CODES, SPLITS

STRING_CHUNK = 65536


def split_code(split: str | int) -> int:
    if isinstance(split, (int, np.integer)):
        if not 0 <= int(split) < len(SPLITS):
            raise ValueError(f"unknown split code {split}; valid: {SPLIT_CODES}")
        return int(split)
    try:
        return SPLIT_CODES[str(split)]
    except KeyError:
        raise ValueError(f"unknown split {split!r}; valid choices: {', '.join(SPLITS)}") from None


class DatasetRows:
    """The images and captions of a store (``self.root``: its Zarr group)."""

    @property
    def dataset(self) -> str:
        return str(self.root.attrs.get("dataset", ""))

    @property
    def image_root(self) -> Path:
        return Path(self.root.attrs.get("image_root") or ".")

    def write_images(self, ids: Sequence[str], paths: Sequence[str], splits: Sequence[str | int]) -> None:
        ids = [str(i) for i in ids]
        seen: set[str] = set()   # the first id met a second time
        dup = next((i for i in ids if i in seen or seen.add(i)), None)
        if dup is not None:
            raise StoreError(f"duplicate image id {dup!r}")
        if not (len(ids) == len(paths) == len(splits)):
            raise StoreError("images: ids, paths and splits must have the same length")
        codes = np.asarray([split_code(s) for s in splits], dtype=np.uint8)
        g = self.root.require_group("images")
        write_strings(g, "id", ids)
        write_strings(g, "path", [str(p) for p in paths])
        write_array(g, "split", codes)

    @property
    def n_images(self) -> int:
        return int(self.root["images/id"].shape[0]) if "images" in self.root else 0

    def image_ids(self) -> np.ndarray:
        return np.asarray(self.root["images/id"][:], dtype=object)

    def image_paths(self) -> np.ndarray:
        return np.asarray(self.root["images/path"][:], dtype=object)

    def image_splits(self) -> np.ndarray:
        return np.asarray(self.root["images/split"][:], dtype=np.uint8)

    def split_rows(self, split: str | int | Iterable[str | int]) -> np.ndarray:
        """Image rows of one split, or of several (``"train,restval"`` or a list)."""
        if isinstance(split, str) and "," in split:
            split = split.split(",")
        names = [split] if isinstance(split, (str, int, np.integer)) else list(split)
        codes = [split_code(s) for s in names]
        return np.flatnonzero(np.isin(self.image_splits(), codes))

    def image_file(self, row: int) -> Path | str:
        """Row ``row``'s image: a path, or a URL where the image root is on object storage."""
        from .sources.remote import image_url, join

        rel, url = self.root["images/path"][row], image_url(self)
        return join(url, str(rel)) if url else self.image_root / str(rel)

    def write_captions(self, text: Sequence[str], image_rows: Sequence[int]) -> None:
        image_rows = np.asarray(image_rows, dtype=np.int64)
        if len(text) != len(image_rows):
            raise StoreError("captions: text and image rows must have the same length")
        if len(image_rows) and (image_rows.min() < 0 or image_rows.max() >= self.n_images):
            bad = int(np.flatnonzero((image_rows < 0) | (image_rows >= self.n_images))[0])
            raise StoreError(f"caption {bad} refers to image row {image_rows[bad]}, "
                             f"but the store has {self.n_images} images")
        g = self.root.require_group("captions")
        write_strings(g, "text", [str(t) for t in text])
        write_array(g, "image", image_rows)

    @property
    def n_captions(self) -> int:
        return int(self.root["captions/text"].shape[0]) if "captions" in self.root else 0

    def caption_text(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.asarray(self.root["captions/text"][start:stop], dtype=object)

    def caption_images(self) -> np.ndarray:
        return np.asarray(self.root["captions/image"][:], dtype=np.int64)

    def captions_of_split(self, split: str | int | Iterable[str | int]) -> np.ndarray:
        rows = self.split_rows(split)
        return np.flatnonzero(np.isin(self.caption_images(), rows))

    @property
    def has_tokens(self) -> bool:
        return "tokens" in self.root and "offsets" in self.root["tokens"]


def write_strings(group: zarr.Group, name: str, values: Sequence[str]) -> zarr.Array:
    """Write a whole variable-length string array (replacing any existing one; ingestion, tokenisation)."""
    return write_array(group, name, np.asarray(values, dtype=object), dtype=str)


def write_array(group: zarr.Group, name: str, values: np.ndarray, chunk: int = STRING_CHUNK,
                dtype: Any = None) -> zarr.Array:
    """Write a whole small array (replacing any existing one)."""
    if name in group:
        del group[name]
    values = np.asarray(values)
    arr = group.create_array(name, shape=values.shape, dtype=dtype or values.dtype,
                             chunks=(max(1, min(chunk, len(values))), *values.shape[1:]))
    if values.size:
        arr[:] = values
    return arr
