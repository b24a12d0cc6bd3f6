"""Per-image ``.npz`` region features as the PyTorch bottom-up-attention ports write them
(bottom-up-attention.pytorch, Anderson et al. CVPR 2018 features): one ``STEM.npz`` per image with
``x`` (num_bbox, C) features, ``bbox`` (num_bbox, 4) boxes in original pixels (x1, y1, x2, y2),
``num_bbox``, ``image_h`` and ``image_w`` (an ``info`` dict may also be there; it is never read,
so no pickle is ever loaded).

Files are matched to an existing store's images by id: the file stem is the id (``--match exact``),
or the stem's last run of digits is the numeric id (``--match number``: ``COCO_val2014_000000391895``
→ ``391895``). The adaptive 10–100 boxes are stored padded to the largest count found, with
``count`` the real number and padded rows zero: the layout of ``ingest butd`` (SCAN/SGRAF's).

A first pass reads each file's small arrays and the headers of ``x``/``bbox`` (not their data); a
second fills the feature set one chunk-aligned row block at a time, so memory is one block.
"""

from __future__ import annotations

import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..store import FeatureStore
from .common import IngestError, IngestReport, RegionBlock

KEYS = ("x", "bbox", "num_bbox", "image_h", "image_w")


@dataclass
class _File:
    path: Path
    n: int
    width: int
    h: int
    w: int


def _header(zf: zipfile.ZipFile, key: str, where: str) -> tuple[tuple[int, ...], np.dtype]:
    with zf.open(f"{key}.npy") as f:
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(f)
    return shape, dtype


def _scalar(npz, key: str, where: str) -> int:
    value = np.asarray(npz[key])
    if value.size != 1:
        raise IngestError(f"{where}: {key!r} should be one number, has shape {value.shape}")
    return int(value.reshape(()))


def scan_file(path: Path, max_boxes: int) -> _File:
    """Check one file's keys and shapes without reading its feature data."""
    where = str(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in KEYS if k not in npz.files]
            if missing:
                raise IngestError(f"{where}: missing array(s) {', '.join(missing)}; expected {', '.join(KEYS)} "
                                  f"(bottom-up-attention.pytorch layout)")
            n, h, w = (_scalar(npz, k, where) for k in ("num_bbox", "image_h", "image_w"))
            zf = npz.zip
            x_shape, x_dtype = _header(zf, "x", where)
            b_shape, _ = _header(zf, "bbox", where)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise IngestError(f"{where}: not a readable .npz ({exc}); truncated file?") from None
    if len(x_shape) != 2 or x_shape[0] != n or b_shape != (n, 4):
        raise IngestError(f"{where}: x has shape {x_shape} and bbox {b_shape}, but num_bbox={n}; expected "
                          f"x ({n}, C) and bbox ({n}, 4)")
    if not 1 <= n <= max_boxes:
        raise IngestError(f"{where}: num_bbox={n} is outside 1..{max_boxes} (--max-boxes)")
    if x_dtype.kind != "f":
        raise IngestError(f"{where}: x has dtype {x_dtype}, expected floating point features")
    return _File(path, n, int(x_shape[1]), h, w)


def _id_of(stem: str, match: str) -> str | None:
    if match == "exact":
        return stem
    if match == "number":
        digits = re.findall(r"\d+", stem)
        return str(int(digits[-1])) if digits else None
    raise ValueError(f"unknown --match {match!r}; valid choices: exact, number")


def ingest_npz(folder: str | Path, store_path: str | Path, *, name: str = "regions", match: str = "exact",
               max_boxes: int = 100, dtype: str = "float16", strict: bool = False,
               overwrite: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Add the ``.npz`` files of ``folder`` to the store's images as region feature set ``name``."""
    folder = Path(folder)
    files = sorted(folder.glob("*.npz"))
    if not files:
        raise IngestError(f"{folder}: no .npz files")
    _id_of("", match)
    store = FeatureStore.open(store_path, mode="r+")
    store_path = store.path
    row_of = {str(i): r for r, i in enumerate(store.image_ids())}
    if match == "number":
        row_of = {(str(int(i)) if i.isdigit() else i): r for i, r in row_of.items()}
    report = IngestReport(strict=strict)
    by_row: dict[int, _File] = {}
    width = None
    for path in files:
        image_id = _id_of(path.stem, match)
        if image_id not in row_of:
            report.skip(f"{path}: image id {image_id} is not in {store_path}")
            continue
        try:
            f = scan_file(path, max_boxes)
            if width is not None and f.width != width:
                raise IngestError(f"{path}: {f.width} features per box, but earlier files have {width}")
        except IngestError as exc:
            report.skip(str(exc))
            continue
        width = f.width
        r = row_of[image_id]
        if r in by_row:
            raise IngestError(f"{path}: image id {image_id} is also given by {by_row[r].path}")
        by_row[r] = f
    if not by_row:
        raise IngestError(f"{folder}: no .npz file matches an image of {store_path}")
    k = max(f.n for f in by_row.values())
    attrs = {"kind": "regions", "model": "butd-faster-rcnn", "weights": "unknown",
             "precision": np.dtype(dtype).name, "source": "npz", "source_files": [str(folder.resolve())],
             "adaptive": min(f.n for f in by_row.values()) != k, "box_format": "x1y1x2y2 pixels"}
    extra = {"boxes": ((k, 4), "float32"), "count": ((), "int16"), "image_size": ((2,), "int32")}
    with store.building_features(name, (k, width), dtype, overwrite=overwrite, attrs=attrs, extra=extra) as fs:
        _write(fs, by_row)
    missing = fs.counts()["failed"]
    report.counts = {"region feature rows": len(by_row), "max boxes": k}
    if missing:
        report.counts["store images without a .npz (marked failed)"] = missing
    return store, report


def _write(fs, by_row: dict[int, _File]) -> None:
    errors = {}
    for block in fs.blocks():
        rb = RegionBlock(fs, block)
        for r in range(block.start, block.stop):
            f = by_row.get(r)
            if f is None:
                errors[r] = "no .npz file for this image"
                continue
            with np.load(f.path, allow_pickle=False) as npz:
                x, b = np.asarray(npz["x"]), np.asarray(npz["bbox"], dtype=np.float32)
            if not (np.all(np.isfinite(x)) and np.all(np.isfinite(b))):
                errors[r] = f"{f.path}: non-finite values in x or bbox"
                continue
            rb.put(r, x, b, f.w, f.h)
        rb.write(fs)
    fs.record_errors(errors)
