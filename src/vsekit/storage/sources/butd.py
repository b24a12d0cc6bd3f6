"""Bottom-up-attention region features (Anderson et al., CVPR 2018) from their ``.tsv`` files.

Each line is ``image_id, image_w, image_h, num_boxes, boxes, features`` separated by tabs, where
``boxes`` is base64 of float32 (num_boxes, 4) in original pixels (x1, y1, x2, y2) and ``features``
base64 of float32 (num_boxes, C) (C = 2048). The released files hold a fixed 36 boxes per image or an
adaptive 10-100; both are stored padded to K boxes with ``count`` giving the real number, padded rows
zero (the layout SCAN/SGRAF read, Lee et al. ECCV 2018).

The files are read twice, one line at a time: a first pass checks every line and records where it
is, a second writes the feature set in chunk-aligned row blocks, seeking to the lines of each block.
Memory is bounded by one block, never by the file size. Into an existing store (``--store`` naming
one) the lines are matched to its images by image id; otherwise a new store is made whose images
are the TSV's (splits from ``split_file``, else ``default_split``).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..store import FeatureStore, split_code, store_exists
from .common import IngestError, IngestReport, RegionBlock, read_split_file

FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")


@dataclass
class _Line:
    file: int
    offset: int
    lineno: int
    image_id: str
    width: int
    height: int
    num_boxes: int


def _b64(text: bytes, where: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise IngestError(f"{where}: field '{field}' is not valid base64 ({exc}); truncated line?") from None


def parse_line(raw: bytes, where: str, max_boxes: int) -> tuple[str, int, int, int, np.ndarray, np.ndarray]:
    """Decode one TSV line → (image_id, w, h, num_boxes, boxes (n, 4), features (n, C)) or raise."""
    parts = raw.rstrip(b"\r\n").split(b"\t")
    if len(parts) < len(FIELDS):
        raise IngestError(f"{where}: truncated line: {len(parts)} of {len(FIELDS)} tab-separated fields "
                          f"({', '.join(FIELDS)})")
    try:
        image_id = parts[0].decode("utf-8").strip()
        w, h, n = (int(p) for p in parts[1:4])
    except (UnicodeDecodeError, ValueError):
        raise IngestError(f"{where}: malformed line: image_id, image_w, image_h, num_boxes must be "
                          f"text and integers, got {b' '.join(parts[:4])[:80]!r}") from None
    if not image_id:
        raise IngestError(f"{where}: malformed line: empty image_id")
    if not 1 <= n <= max_boxes:
        raise IngestError(f"{where}: num_boxes={n} is outside 1..{max_boxes} (--max-boxes)")
    boxes_raw, feats_raw = _b64(parts[4], where, "boxes"), _b64(parts[5], where, "features")
    if len(boxes_raw) != n * 16:
        raise IngestError(f"{where}: 'boxes' holds {len(boxes_raw)} bytes, expected {n}x4 float32 = "
                          f"{n * 16}; truncated line?")
    if not feats_raw or len(feats_raw) % (n * 4):
        raise IngestError(f"{where}: 'features' holds {len(feats_raw)} bytes, not a multiple of "
                          f"{n} boxes x float32; truncated line?")
    boxes = np.frombuffer(boxes_raw, dtype="<f4").reshape(n, 4)
    feats = np.frombuffer(feats_raw, dtype="<f4").reshape(n, -1)
    if not (np.all(np.isfinite(boxes)) and np.all(np.isfinite(feats))):
        raise IngestError(f"{where}: non-finite values in boxes or features")
    return image_id, w, h, n, boxes, feats


def _scan(paths: list[Path], max_boxes: int, report: IngestReport) -> tuple[list[_Line], int]:
    """First pass: check every line, remember where it is; returns the lines and the feature width.

    The width is the one most lines have (not the first line's): a truncated or damaged first line
    must not turn every good line after it into a skip. Lines of another width are skipped.
    """
    parsed: list[tuple[_Line, int, str]] = []
    for fi, path in enumerate(paths):
        if not path.is_file():
            raise IngestError(f"{path}: no such file")
        with open(path, "rb") as f:
            lineno = 0
            while True:
                offset = f.tell()
                raw = f.readline()
                if not raw:
                    break
                lineno += 1
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    image_id, w, h, n, _, feats = parse_line(raw, where, max_boxes)
                except IngestError as exc:
                    report.skip(str(exc))
                    continue
                parsed.append((_Line(fi, offset, lineno, image_id, w, h, n), feats.shape[1], where))
    if not parsed:
        raise IngestError(f"{', '.join(map(str, paths))}: no usable BUTD lines")
    widths, votes = np.unique([wd for _, wd, _ in parsed], return_counts=True)
    width = int(widths[np.argmax(votes)])
    lines: list[_Line] = []
    first: dict[str, str] = {}
    for ln, wd, where in parsed:
        if wd != width:
            report.skip(f"{where}: {wd} features per box, but most lines have {width}; truncated line?")
            continue
        if ln.image_id in first:
            raise IngestError(f"{where}: duplicate image id {ln.image_id} (first at {first[ln.image_id]})")
        first[ln.image_id] = where
        lines.append(ln)
    return lines, width


def ingest_butd(tsv_files: Sequence[str | Path], store_path: str | Path, *, name: str = "regions",
                max_boxes: int = 100, split_file: str | Path | None = None, default_split: str = "train",
                dtype: str = "float16", strict: bool = False, overwrite: bool = False,
                dataset: str | None = None) -> tuple[FeatureStore, IngestReport]:
    """Add BUTD region features to an existing store (matched by image id) or make a new store.

    ``overwrite`` replaces the feature set ``name`` of an existing store, or the whole store when
    making a new one.
    """
    paths = [Path(p) for p in tsv_files]
    if not paths:
        raise IngestError("ingest butd: give at least one .tsv file")
    split_code(default_split)
    report = IngestReport(strict=strict)
    lines, width = _scan(paths, max_boxes, report)
    attach = store_exists(store_path)   # a path or an object-store URL
    k = max(ln.num_boxes for ln in lines)
    attrs = {"kind": "regions", "model": "butd-faster-rcnn", "weights": "unknown",
             "precision": np.dtype(dtype).name, "source": "butd",
             "source_files": [str(p.resolve()) for p in paths],
             "adaptive": min(ln.num_boxes for ln in lines) != k, "box_format": "x1y1x2y2 pixels"}
    extra = {"boxes": ((k, 4), "float32"), "count": ((), "int16"), "image_size": ((2,), "int32")}
    if attach:
        store = FeatureStore.open(store_path, mode="r+")
        store_path = store.path
        row_of = {str(i): r for r, i in enumerate(store.image_ids())}
        rows = []
        for ln in lines:
            if ln.image_id not in row_of:
                report.skip(f"{paths[ln.file]}:{ln.lineno}: image id {ln.image_id} is not in {store_path}")
                continue
            rows.append((row_of[ln.image_id], ln))
        if not rows:
            raise IngestError(f"no image id of {', '.join(map(str, paths))} is in {store_path}")
        with store.building_features(name, (k, width), dtype, overwrite=overwrite, attrs=attrs,
                                     extra=extra) as fs:
            _write(fs, rows, paths)
        missing = fs.counts()["failed"]
        if missing:
            report.counts["store images without BUTD features (marked failed)"] = missing
    else:
        splits = read_split_file(split_file) if split_file else {}
        kept = []
        for ln in lines:
            split = splits.get(ln.image_id, None if split_file else default_split)
            if split is None:
                report.skip(f"{paths[ln.file]}:{ln.lineno}: image id {ln.image_id} has no split in {split_file}")
                continue
            kept.append((ln, split))
        if not kept:
            raise IngestError(f"{', '.join(map(str, paths))}: no image has a split in {split_file}")
        with FeatureStore.building(store_path, overwrite=overwrite, dataset=dataset or paths[0].stem,
                                   source_files=attrs["source_files"]) as store:
            store.write_images([ln.image_id for ln, _ in kept], [""] * len(kept), [s for _, s in kept])
            fs = store.create_features(name, (k, width), dtype, attrs=attrs, extra=extra)
            _write(fs, [(r, ln) for r, (ln, _) in enumerate(kept)], paths)
        rows = kept
    report.counts = {"region feature rows": len(rows), "max boxes": k, **report.counts}
    return store, report


def _write(fs, rows: list[tuple[int, _Line]], paths: list[Path]) -> None:
    """Second pass: fill each chunk-aligned block from its lines; rows without a line are failed."""
    by_row = dict(rows)
    handles = [open(p, "rb") for p in paths]
    k = fs.shape[1]
    errors = {}
    try:
        for block in fs.blocks():
            rb = RegionBlock(fs, block)
            todo = sorted((by_row[r].file, by_row[r].offset, r) for r in range(block.start, block.stop)
                          if r in by_row)
            for fi, offset, r in todo:
                handles[fi].seek(offset)
                _, w, h, nb, b, feats = parse_line(handles[fi].readline(), f"{paths[fi]}:{by_row[r].lineno}",
                                                   k)
                rb.put(r, feats, b, w, h)
            for r in rb.failed_rows():
                errors[r] = "no line for this image in the BUTD files"
            rb.write(fs)
    finally:
        for h in handles:
            h.close()
    fs.record_errors(errors)
