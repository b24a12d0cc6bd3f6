"""Official COCO caption annotations (``captions_train2014.json`` ...) plus a split assignment file.

An annotation file has ``images`` (``id``, ``file_name``) and ``annotations`` (``image_id``,
``caption``). The split of each image comes from a separate file: the Karpathy split JSON
(``dataset_coco.json``, matched by ``cocoid``), a JSON object ``{image_id: split}``, or a text file of
``image_id<TAB>split`` lines. Image files are looked up by one rule (:data:`LOOKUP_RULE`):
``IMAGE_ROOT/file_name``, then ``IMAGE_ROOT/<set>/file_name`` for the set named in the file name
(``COCO_val2014_...`` → ``val2014``) and then for each of COCO's split folders (``train2014``,
``val2014``, ``test2014``, ``train2017``, ``val2017``, ``test2017``, the layouts the official zips
unpack to), so plain file names such as ``000000391895.jpg`` are found in ``train2014/`` too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..store import FeatureStore
from .common import (ImageRoot, IngestError, IngestReport, check_inside_root, no_images_error, read_json,
                     read_split_file, write_store)


#: COCO's split folders, searched below the image root for every file name
SPLIT_FOLDERS = ("train2014", "val2014", "test2014", "train2017", "val2017", "test2017")
LOOKUP_RULE = (f"IMAGE_ROOT/file_name, then IMAGE_ROOT/SET/file_name for SET in the file name's own set "
               f"(COCO_val2014_... → val2014) and {', '.join(SPLIT_FOLDERS)}")


def _candidates(file_name: str) -> list[str]:
    names = [file_name]
    parts = Path(file_name).stem.split("_")
    if len(parts) >= 3:  # COCO_val2014_000000391895 → val2014/COCO_val2014_000000391895.jpg
        names.append(str(Path(parts[1]) / file_name))
    for folder in SPLIT_FOLDERS:
        name = str(Path(folder) / file_name)
        if name not in names:
            names.append(name)
    return names


def ingest_coco(annotation_files: Sequence[str | Path], split_file: str | Path, image_root: str | Path,
                store_path: str | Path, *, restval_as_train: bool = False, strict: bool = False,
                check_files: bool = True, overwrite: bool = False, drop_features: bool = False,
                dataset: str = "coco", allow_outside_root: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Create a store from COCO caption annotation files; returns the store and a skip report."""
    if not annotation_files:
        raise IngestError("ingest coco: give at least one captions_*.json file")
    image_root = ImageRoot(image_root)
    splits = read_split_file(split_file)
    report = IngestReport(strict=strict)
    ids: list[str] = []
    paths: list[str] = []
    split_of: list[str] = []
    row_of: dict[str, int] = {}
    first_seen: dict[str, str] = {}
    texts: list[str] = []
    owners: list[int] = []
    looked_for = None
    for ann_path in map(Path, annotation_files):
        doc = read_json(ann_path)
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list) \
                or not isinstance(doc.get("annotations"), list):
            raise IngestError(f"{ann_path}: expected an object with 'images' and 'annotations' lists "
                              f"(COCO captions format)")
        for pos, rec in enumerate(doc["images"]):
            where = f"{ann_path}: images[{pos}]"
            if not isinstance(rec, dict) or "id" not in rec or "file_name" not in rec:
                raise IngestError(f"{where}: an image record needs 'id' and 'file_name'")
            image_id = str(rec["id"])
            if image_id in first_seen:
                raise IngestError(f"{where}: duplicate image id {image_id} (first at {first_seen[image_id]})")
            first_seen[image_id] = where
            split = splits.get(image_id)
            if split is None:
                report.skip(f"{where}: image id {image_id} has no split in {split_file}")
                continue
            if split == "restval" and restval_as_train:
                split = "train"
            if not isinstance(rec["file_name"], str):
                raise IngestError(f"{where}: field 'file_name' must be a string, got "
                                  f"{_json_type(rec['file_name'])}")
            options = _candidates(rec["file_name"])
            rel = None
            for candidate in options:   # every place it may be read from, up to the one it is read from
                check_inside_root(image_root.root, candidate, f"{where}.file_name", allow_outside_root)
                if image_root.exists(candidate):
                    rel = candidate
                    break
            if rel is None:
                if check_files:
                    looked_for = looked_for or image_root / options[0]
                    report.skip(f"{where}: image file {image_root / options[0]} is missing (looked for "
                                f"{LOOKUP_RULE})")
                    continue
                rel = options[0]
            row_of[image_id] = len(ids)
            ids.append(image_id)
            paths.append(rel)
            split_of.append(split)
        for pos, ann in enumerate(doc["annotations"]):
            where = f"{ann_path}: annotations[{pos}]"
            if not isinstance(ann, dict) or "image_id" not in ann or "caption" not in ann:
                raise IngestError(f"{where}: an annotation needs 'image_id' and 'caption'")
            image_id = str(ann["image_id"])
            if image_id not in first_seen:
                report.skip(f"{where}: caption for unknown image id {image_id}")
                continue
            if image_id not in row_of:  # the image itself was skipped (and reported) above
                continue
            if not isinstance(ann.get("caption"), str):
                raise IngestError(f"{where}: field 'caption' must be a string, got {_json_type(ann.get('caption'))}")
            text = ann["caption"].strip()
            if not text:
                report.skip(f"{where}: empty caption for image {image_id}")
                continue
            texts.append(" ".join(text.split()))
            owners.append(row_of[image_id])
    if not ids:
        err = no_images_error(", ".join(map(str, annotation_files)), image_root.root, looked_for)
        raise IngestError(f"{err}; a file name is looked for as {LOOKUP_RULE}") if looked_for else err
    sources = [str(Path(p).resolve()) for p in annotation_files] + [str(Path(split_file).resolve())]
    return write_store(store_path, report, ids, paths, split_of, texts, owners,
                       image_root.attrs(allow_outside_root, restval_as_train=bool(restval_as_train)),
                       overwrite=overwrite, drop_features=drop_features, dataset=dataset,
                       image_root=image_root.local, source_files=sources)


def _json_type(value) -> str:
    """The JSON name of a value's type, as a message shows it (``None`` for null)."""
    if value is None:
        return "None"
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)
