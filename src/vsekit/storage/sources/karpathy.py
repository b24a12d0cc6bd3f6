"""Karpathy split files: ``dataset_coco.json``, ``dataset_flickr30k.json``, ``dataset_flickr8k.json``.

Each image record has ``filepath`` (COCO only), ``filename``, ``split`` (train/val/test/restval),
``sentences`` with ``raw`` text, and ``cocoid`` (COCO) or ``imgid``. With ``restval_as_train`` the
COCO ``restval`` images join train (113,287 training images, the common practice); otherwise they
keep their own split code.
"""

from __future__ import annotations

from pathlib import Path

from ..store import SPLITS, FeatureStore
from .common import (ImageRoot, IngestError, IngestReport, check_inside_root, no_images_error, read_json,
                     write_store)


def ingest_karpathy(json_path: str | Path, image_root: str | Path, store_path: str | Path, *,
                    restval_as_train: bool = False, strict: bool = False, check_files: bool = True,
                    overwrite: bool = False, drop_features: bool = False, dataset: str | None = None,
                    allow_outside_root: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Create a store from a Karpathy split file; malformed records are errors naming the image
    index and field, and image paths that leave ``image_root`` are refused unless
    ``allow_outside_root``."""
    json_path, image_root = Path(json_path), ImageRoot(image_root)
    doc = read_json(json_path)
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise IngestError(f"{json_path}: expected an object with an 'images' list (Karpathy format)")
    report = IngestReport(strict=strict)
    ids, paths, splits, texts, owners = [], [], [], [], []
    seen: dict[str, int] = {}
    looked_for = None
    for pos, rec in enumerate(doc["images"]):
        where = f"{json_path}: images[{pos}]"
        if not isinstance(rec, dict) or "filename" not in rec or "split" not in rec:
            raise IngestError(f"{where}: an image record needs 'filename' and 'split'")
        _check_types(rec, where)
        image_id = str(rec.get("cocoid", rec.get("imgid", Path(rec["filename"]).stem)))
        if image_id in seen:
            raise IngestError(f"{where}: duplicate image id {image_id} (first at images[{seen[image_id]}])")
        seen[image_id] = pos
        split = rec["split"]
        if split not in SPLITS:
            raise IngestError(f"{where}: unknown split {split!r}; valid: {', '.join(SPLITS)}")
        if split == "restval" and restval_as_train:
            split = "train"
        rel = str(Path(rec.get("filepath", "")) / rec["filename"])
        check_inside_root(image_root.root, rel, f"{where}.filepath/filename", allow_outside_root)
        if check_files and not image_root.exists(rel):
            looked_for = looked_for or image_root / rel
            report.skip(f"{where}: image file {image_root / rel} is missing")
            continue
        sentences = rec.get("sentences") or []
        caps = []
        for j, sent in enumerate(sentences):
            raw = sent.get("raw") if isinstance(sent, dict) else None
            if raw is None or not str(raw).strip():
                report.skip(f"{where}.sentences[{j}]: empty caption")
                continue
            caps.append(str(raw).strip())
        row = len(ids)
        ids.append(image_id)
        paths.append(rel)
        splits.append(split)
        texts.extend(caps)
        owners.extend([row] * len(caps))
    if not ids:
        raise no_images_error(json_path, image_root.root, looked_for)
    return write_store(store_path, report, ids, paths, splits, texts, owners,
                       image_root.attrs(allow_outside_root, restval_as_train=bool(restval_as_train)),
                       overwrite=overwrite, drop_features=drop_features, image_root=image_root.local,
                       dataset=dataset or doc.get("dataset") or json_path.stem.replace("dataset_", ""),
                       source_files=[str(json_path.resolve())])


def _check_types(rec: dict, where: str) -> None:
    """Refuse fields of the wrong JSON type (an int filename, a null filepath, int sentences)."""
    if not isinstance(rec["filename"], str) or not rec["filename"].strip():
        raise IngestError(f"{where}: field 'filename' must be a non-empty string, got {rec['filename']!r}")
    if "filepath" in rec and not isinstance(rec["filepath"], str):
        raise IngestError(f"{where}: field 'filepath' must be a string, got {rec['filepath']!r}")
    if not isinstance(rec["split"], str):
        raise IngestError(f"{where}: field 'split' must be a string, got {rec['split']!r}")
    if rec.get("sentences") is not None and not isinstance(rec["sentences"], list):
        raise IngestError(f"{where}: field 'sentences' must be a list of {{'raw': text}}, "
                          f"got {type(rec['sentences']).__name__} {rec['sentences']!r}")
    for j, sent in enumerate(rec.get("sentences") or []):   # a list of strings would give 0 captions
        if not isinstance(sent, dict):
            raise IngestError(f"{where}.sentences[{j}]: must be an object {{'raw': text}}, "
                              f"got {type(sent).__name__} {str(sent)[:60]!r}")
        if sent.get("raw") is not None and not isinstance(sent["raw"], str):
            raise IngestError(f"{where}.sentences[{j}]: field 'raw' must be a string, got {sent['raw']!r}")
