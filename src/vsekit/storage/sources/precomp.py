"""Precomputed-feature folders: the VSE++ layout and the SCAN/SGRAF layout.

VSE++ (Faghri et al.) ``data/<name>_precomp/``: ``{split}_ims.npy`` of (N, D) or (5N, D) and
``{split}_caps.txt`` with 5 consecutive captions per image. Its loader divides the caption index by 5
when the image array is shorter than the caption list, so the image rows are either one per image or
repeated once per caption; both are detected here (and the repeat is checked on the first image).
SCAN / SGRAF (Lee et al., Diao et al.) use the same names with ``{split}_ims.npy`` of (N, 36, 2048)
bottom-up region features and a ``{split}_ids.txt`` of image ids (one per image, or one per caption).

File prefixes map to store splits as ``train→train, dev|val→val, test|testall→test, restval→restval``.
The ingest becomes a new store: images (ids from ``_ids.txt`` or ``<prefix>_<row>``), captions, and a
feature set of kind ``global`` (2-D rows) or ``regions`` (3-D rows; ``count`` = K, ``boxes`` zero
since the layout carries none). Features are copied in chunk-aligned row blocks from memory-mapped
``.npy`` files, so memory stays bounded by the chunk size. When ``store_path`` is an existing store,
only the feature set is added to it, its rows matched to the store's images by id (ids the store
lacks are skipped and reported; store images without a precomp row are marked failed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..store import DONE, FAILED, FeatureStore, store_exists
from .common import IngestError, IngestReport, read_text_lines

PREFIX_SPLITS = {"train": "train", "dev": "val", "val": "val", "test": "test", "testall": "test",
                 "restval": "restval"}
DEFAULT_PREFIXES = ("train", "dev", "val", "test", "restval")


@dataclass
class _Part:
    prefix: str
    ims: np.ndarray          # memory-mapped
    repeat: int              # 1, or captions-per-image when image rows are repeated
    n_images: int
    start: int = 0           # first store row


def _load_part(folder: Path, prefix: str, cpi: int, report: IngestReport,
               ids: list[str], texts: list[str], owners: list[int], seen: dict[str, str]) -> _Part:
    npy, caps_path, ids_path = (folder / f"{prefix}_ims.npy", folder / f"{prefix}_caps.txt",
                                folder / f"{prefix}_ids.txt")
    try:
        ims = np.load(npy, mmap_mode="r")
    except (ValueError, OSError) as exc:
        raise IngestError(f"{npy}: not a readable .npy array ({exc})") from None
    if ims.ndim not in (2, 3):
        raise IngestError(f"{npy}: expected (N, D) or (N, K, D) features, got shape {ims.shape}")
    caps = read_text_lines(caps_path)
    n_caps, n_rows = len(caps), int(ims.shape[0])
    if n_caps == 0:
        raise IngestError(f"{caps_path}: no captions")
    if n_rows * cpi == n_caps:
        repeat = 1
    elif n_rows == n_caps and n_caps % cpi == 0:
        repeat = cpi
        if n_rows >= cpi and not all(np.array_equal(ims[0], ims[k]) for k in range(1, cpi)):
            raise IngestError(f"{npy}: has one row per caption ({n_rows}) but rows 0..{cpi - 1} differ; "
                              f"expected each image's row repeated {cpi}x")
    else:
        raise IngestError(f"{npy}: {n_rows} rows do not match the {n_caps} captions in {caps_path} "
                          f"(expected {n_caps // cpi} rows, one per {cpi} captions, or {n_caps}, "
                          f"one per caption)")
    n_images = n_caps // cpi
    if ids_path.exists():
        lines = read_text_lines(ids_path)
        if len(lines) == n_images:
            part_ids = [x.strip() for x in lines]
        elif len(lines) == n_caps:
            part_ids = []
            for i in range(n_images):
                group = {x.strip() for x in lines[i * cpi:(i + 1) * cpi]}
                if len(group) != 1:
                    raise IngestError(f"{ids_path}:{i * cpi + 1}: the {cpi} caption ids of image row {i} "
                                      f"differ ({', '.join(sorted(group))})")
                part_ids.append(group.pop())
        else:
            raise IngestError(f"{ids_path}: {len(lines)} ids, but {caps_path} describes {n_images} images "
                              f"({n_caps} captions); expected one id per image or per caption")
    else:
        part_ids = [f"{prefix}_{i}" for i in range(n_images)]
    base = len(ids)
    for i, image_id in enumerate(part_ids):
        where = f"{ids_path}:{i + 1}" if ids_path.exists() else f"{npy}: row {i}"
        if not image_id:
            raise IngestError(f"{where}: empty image id")
        if image_id in seen:
            raise IngestError(f"{where}: duplicate image id {image_id} (first at {seen[image_id]})")
        seen[image_id] = where
    ids.extend(part_ids)
    for j, text in enumerate(caps):
        text = " ".join(text.split())
        if not text:
            report.skip(f"{caps_path}:{j + 1}: empty caption")
            continue
        texts.append(text)
        owners.append(base + j // cpi)
    return _Part(prefix, ims, repeat, n_images, base)


def ingest_precomp(folder: str | Path, store_path: str | Path, *, prefixes: Sequence[str] | None = None,
                   name: str = "precomp", captions_per_image: int = 5, dtype: str | None = None,
                   strict: bool = False, overwrite: bool = False,
                   dataset: str | None = None) -> tuple[FeatureStore, IngestReport]:
    """Create a store (images, captions, one feature set ``name``) from a precomp folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise IngestError(f"{folder}: no such folder")
    if prefixes is None:
        prefixes = [p for p in DEFAULT_PREFIXES if (folder / f"{p}_ims.npy").exists()]
        if "dev" in prefixes and "val" in prefixes:
            prefixes.remove("val")
        if not prefixes:
            raise IngestError(f"{folder}: no {{split}}_ims.npy files (looked for "
                              f"{', '.join(DEFAULT_PREFIXES)})")
    for p in prefixes:
        if p not in PREFIX_SPLITS:
            raise ValueError(f"--prefixes: unknown precomp split {p!r}; valid: {', '.join(PREFIX_SPLITS)}")
    report = IngestReport(strict=strict)
    ids: list[str] = []
    texts: list[str] = []
    owners: list[int] = []
    seen: dict[str, str] = {}
    parts = [_load_part(folder, p, captions_per_image, report, ids, texts, owners, seen) for p in prefixes]
    shapes = {tuple(part.ims.shape[1:]) for part in parts}
    if len(shapes) != 1:
        raise IngestError(f"{folder}: the splits' feature rows differ in shape: "
                          + ", ".join(f"{p.prefix} {tuple(p.ims.shape[1:])}" for p in parts))
    row_shape = shapes.pop()
    kind = "global" if len(row_shape) == 1 else "regions"
    out_dtype = np.dtype(dtype or ("float16" if kind == "regions" else parts[0].ims.dtype))
    splits = [PREFIX_SPLITS[p.prefix] for p in parts for _ in range(p.n_images)]
    files = [str((folder / f"{p.prefix}_{x}").resolve()) for p in parts for x in ("ims.npy", "caps.txt")]
    attrs = {"kind": kind, "model": "precomp", "weights": "unknown", "precision": out_dtype.name,
             "source": "precomp", "source_files": files, "captions_per_image": captions_per_image}
    extra = {"boxes": ((row_shape[0], 4), "float32"), "count": ((), "int16")} if kind == "regions" else None
    if store_exists(store_path):  # add the features to an existing store, matched by id (a path or a URL)
        store = FeatureStore.open(store_path, mode="r+")
        store_path = store.path
        row_of = {str(i): r for r, i in enumerate(store.image_ids())}
        source = np.full(store.n_images, -1, dtype=np.int64)
        for j, image_id in enumerate(ids):
            if image_id not in row_of:
                report.skip(f"{seen[image_id]}: image id {image_id} is not in {store_path}")
                continue
            source[row_of[image_id]] = j
        if not np.any(source >= 0):
            raise IngestError(f"no image id of {folder} is in {store_path} (ids come from "
                              f"{{split}}_ids.txt files)")
        with store.building_features(name, row_shape, out_dtype, overwrite=overwrite, attrs=attrs,
                                     extra=extra) as fs:
            _fill(fs, source, parts, ids)
        missing = int(np.sum(source < 0))
        if missing:
            report.counts["store images without precomp features (marked failed)"] = missing
        report.counts = {f"{kind} feature rows": int(np.sum(source >= 0)), **report.counts}
        return store, report
    with FeatureStore.building(store_path, overwrite=overwrite, dataset=dataset or folder.name,
                               source_files=files) as store:
        store.write_images(ids, [""] * len(ids), splits)
        store.write_captions(texts, owners)
        fs = store.create_features(name, row_shape, out_dtype, attrs=attrs, extra=extra)
        _fill(fs, np.arange(len(ids)), parts, ids)
    report.counts = {"images": len(ids), "captions": len(texts), f"{kind} feature rows": len(ids)}
    return store, report


def _fill(fs, source: np.ndarray, parts: list[_Part], ids: list[str]) -> None:
    """Write every chunk-aligned block of ``fs``: store row r gets source image ``source[r]`` (-1: none)."""
    row_shape, regions = fs.shape[1:], fs.has_array("count")
    errors = {}
    for block in fs.blocks():
        src = source[block.start:block.stop]
        data = np.zeros((len(block), *row_shape), dtype=fs.data.dtype)
        for part in parts:
            sel = np.flatnonzero((src >= part.start) & (src < part.start + part.n_images))
            if len(sel):
                order = sel[np.argsort(src[sel])]
                data[order] = part.ims[(np.sort(src[sel]) - part.start) * part.repeat]
        if data.dtype.kind == "f" and not np.all(np.isfinite(data)):
            bad = int(np.flatnonzero(~np.isfinite(data.reshape(len(block), -1)).all(1))[0])
            raise IngestError(f"precomp features of image {ids[src[bad]]} have non-finite values")
        status = np.where(src >= 0, DONE, FAILED).astype(np.uint8)
        errors.update({block.start + int(i): "no row for this image in the precomp files"
                       for i in np.flatnonzero(src < 0)})
        aux = {"count": np.where(src >= 0, row_shape[0], 0).astype(np.int16)} if regions else {}
        fs.write_block(block, data, status=status, **aux)
    fs.record_errors(errors)
