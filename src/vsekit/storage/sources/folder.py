"""A folder of images plus a caption table: ``path<TAB>caption[<TAB>split]`` lines.

Several lines may name the same image (one caption each). ``.csv`` files are read as CSV (quoted
fields allowed), anything else as tab-separated. A first line ``path<TAB>caption[<TAB>split]`` is
taken as a header. Without a split column the images are split at random by ``ratios``
(train, val, test) with ``seed``; the assignment is a pure function of the image list and the seed.
An image's id is its path relative to the folder, without the extension.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path, PurePosixPath
from typing import Sequence

import numpy as np

from ..store import SPLITS, FeatureStore
from .common import ImageRoot, IngestError, IngestReport, check_inside_root, no_images_error, write_store


def parse_ratios(text: str | Sequence[float]) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` → (0.8, 0.1, 0.1); they must be non-negative and sum to 1."""
    try:
        parts = [float(x) for x in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise ValueError(f"--split {text!r}: expected three numbers train,val,test such as 0.8,0.1,0.1") from None
    if len(parts) != 3 or min(parts) < 0 or abs(sum(parts) - 1) > 1e-6:
        raise ValueError(f"--split {text!r}: expected three non-negative ratios train,val,test summing to 1")
    return parts[0], parts[1], parts[2]


def _fields(raw: bytes, is_csv: bool) -> list[str]:
    line = raw.decode("utf-8").rstrip("\r\n")
    if is_csv:
        return next(csv.reader(io.StringIO(line)), [])
    return line.split("\t")


def assign_splits(n: int, ratios: tuple[float, float, float], seed: int) -> list[str]:
    """Split ``n`` items at random: the first ``round(n*train)`` of a seeded permutation are train..."""
    order = np.random.default_rng(seed).permutation(n)
    n_train = int(round(n * ratios[0]))
    n_val = min(n - n_train, int(round(n * ratios[1])))
    out = ["test"] * n
    for k, i in enumerate(order):
        out[i] = "train" if k < n_train else "val" if k < n_train + n_val else "test"
    return out


def ingest_folder(image_dir: str | Path, captions_file: str | Path, store_path: str | Path, *,
                  ratios: str | Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0, strict: bool = False,
                  check_files: bool = True, overwrite: bool = False, drop_features: bool = False,
                  dataset: str | None = None, allow_outside_root: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Create a store from an image folder and a caption table; returns the store and a skip report.

    Image paths that leave ``image_dir`` (absolute, ``..``, symlinks out) are refused unless
    ``allow_outside_root``."""
    image_dir, captions_file = ImageRoot(image_dir), Path(captions_file)
    if not isinstance(image_dir.root, str) and not image_dir.root.is_dir():
        raise IngestError(f"{image_dir}: no such folder")
    if not captions_file.is_file():
        raise IngestError(f"{captions_file}: no such file")
    ratios = parse_ratios(ratios)
    is_csv = captions_file.suffix.lower() == ".csv"
    report = IngestReport(strict=strict)
    row_of: dict[str, int] = {}
    paths: list[str] = []
    given_split: list[str | None] = []
    texts: list[str] = []
    owners: list[int] = []
    missing: set[str] = set()
    has_split_column: bool | None = None
    first_line: list[int] = []
    looked_for = None
    with open(captions_file, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{captions_file}:{lineno}"
            if not raw.strip():
                continue
            try:
                parts = _fields(raw, is_csv)
            except (UnicodeDecodeError, csv.Error) as exc:
                report.skip(f"{where}: unreadable line ({exc.__class__.__name__}: {exc})")
                continue
            if lineno == 1 and [p.strip().lower() for p in parts[:2]] == ["path", "caption"]:
                has_split_column = len(parts) == 3
                continue
            if len(parts) not in (2, 3):
                report.skip(f"{where}: unreadable line: expected path<TAB>caption[<TAB>split], "
                            f"got {len(parts)} field(s)")
                continue
            if has_split_column is None:
                has_split_column = len(parts) == 3
            if (len(parts) == 3) != has_split_column:
                report.skip(f"{where}: unreadable line: {len(parts)} fields, but the file's lines have "
                            f"{3 if has_split_column else 2}")
                continue
            rel = PurePosixPath(parts[0].strip().replace("\\", "/")).as_posix()
            text = " ".join(parts[1].split())
            split = parts[2].strip() if has_split_column else None
            if split is not None and split not in SPLITS:
                report.skip(f"{where}: unknown split {split!r}; valid: {', '.join(SPLITS)}")
                continue
            if rel in missing:
                continue
            if rel not in row_of:
                check_inside_root(image_dir.root, rel, f"{where}: path column", allow_outside_root)
                if check_files and not image_dir.exists(rel):
                    looked_for = looked_for or image_dir / rel
                    missing.add(rel)
                    report.skip(f"{where}: image file {image_dir / rel} is missing")
                    continue
                row_of[rel] = len(paths)
                paths.append(rel)
                first_line.append(lineno)
                given_split.append(split)
            row = row_of[rel]
            if split is not None and given_split[row] != split:
                raise IngestError(f"{where}: image {rel} is in split {split!r} here but "
                                  f"{given_split[row]!r} on an earlier line")
            if not text:
                report.skip(f"{where}: empty caption for image {rel}")
                continue
            texts.append(text)
            owners.append(row)
    if not paths:
        raise no_images_error(captions_file, image_dir.root, looked_for)
    splits = given_split if has_split_column else assign_splits(len(paths), ratios, seed)
    ids = [str(PurePosixPath(p).with_suffix("")) for p in paths]
    seen: dict[str, int] = {}
    for row, image_id in enumerate(ids):
        if image_id in seen:
            raise IngestError(f"{captions_file}:{first_line[row]}: duplicate image id {image_id!r} "
                              f"({paths[row]} and {paths[seen[image_id]]} on line "
                              f"{first_line[seen[image_id]]})")
        seen[image_id] = row
    how = "column" if has_split_column else {"ratios": list(ratios), "seed": int(seed)}
    return write_store(store_path, report, ids, paths, splits, texts, owners,
                       image_dir.attrs(allow_outside_root, split_source=how), overwrite=overwrite,
                       drop_features=drop_features, dataset=dataset or captions_file.stem,
                       image_root=image_dir.local, source_files=[str(captions_file.resolve())])
