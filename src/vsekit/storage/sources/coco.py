"""Official COCO caption annotations (``captions_train2014.json`` ...) plus a split assignment file.

An annotation file has ``images`` (``id``, ``file_name``) and ``annotations`` (``image_id``,
``caption``). The split of each image comes from a separate file: the Karpathy split JSON
(``dataset_coco.json``, matched by ``cocoid``), a JSON object ``{image_id: split}``, or a text file of
``image_id<TAB>split`` lines. Image files are looked up as ``IMAGE_ROOT/file_name`` and, failing
that, ``IMAGE_ROOT/<set>/file_name`` where ``<set>`` is the ``train2014`` / ``val2014`` part of the
COCO file name (the layout the official zips unpack to).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..store import FeatureStore
from .common import IngestError, IngestReport, read_json, read_split_file, check_inside_root, no_images_error


def _candidates(file_name: str) -> list[str]:
    names = [file_name]
    parts = Path(file_name).stem.split("_")
    if len(parts) >= 3:  # COCO_val2014_000000391895 → val2014/COCO_val2014_000000391895.jpg
        names.append(str(Path(parts[1]) / file_name))
    return names


def ingest_coco(annotation_files: Sequence[str | Path], split_file: str | Path, image_root: str | Path,
                store_path: str | Path, *, restval_as_train: bool = False, strict: bool = False,
                check_files: bool = True, overwrite: bool = False,
                dataset: str = "coco", allow_outside_root: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Create a store from COCO caption annotation files; returns the store and a skip report."""
    if not annotation_files:
        raise IngestError("ingest coco: give at least one captions_*.json file")
    image_root = Path(image_root)
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
            options = _candidates(str(rec["file_name"]))
            for candidate in options:   # every place it may be read from, not only the first
                check_inside_root(image_root, candidate, f"{where}.file_name", allow_outside_root)
            rel = next((c for c in options if (image_root / c).is_file()), None)
            if rel is None:
                if check_files:
                    looked_for = looked_for or image_root / options[0]
                    report.skip(f"{where}: image file {image_root / options[0]} is missing")
                    continue
                rel = options[0]
            row_of[image_id] = len(ids)
            ids.append(image_id)
            paths.append(rel)
            split_of.append(split)
        for pos, ann in enumerate(doc["annotations"]):
            where = f"{ann_path}: annotations[{pos}]"
            if not isinstance(ann, dict) or "image_id" not in ann:
                raise IngestError(f"{where}: an annotation needs 'image_id' and 'caption'")
            image_id = str(ann["image_id"])
            if image_id not in first_seen:
                report.skip(f"{where}: caption for unknown image id {image_id}")
                continue
            if image_id not in row_of:  # the image itself was skipped (and reported) above
                continue
            text = str(ann.get("caption") or "").strip()
            if not text:
                report.skip(f"{where}: empty caption for image {image_id}")
                continue
            texts.append(" ".join(text.split()))
            owners.append(row_of[image_id])
    if not ids:
        raise no_images_error(", ".join(map(str, annotation_files)), image_root, looked_for)
    sources = [str(Path(p).resolve()) for p in annotation_files] + [str(Path(split_file).resolve())]
    with FeatureStore.building(store_path, overwrite=overwrite, dataset=dataset, image_root=image_root,
                               source_files=sources) as store:
        store.write_images(ids, paths, split_of)
        store.write_captions(texts, owners)
        store.root.attrs["restval_as_train"] = bool(restval_as_train)
        store.root.attrs["allow_outside_root"] = bool(allow_outside_root)   # extract checks again unless so
    report.counts = {"images": len(ids), "captions": len(texts)}
    return store, report
