"""Karpathy split files: ``dataset_coco.json``, ``dataset_flickr30k.json``, ``dataset_flickr8k.json``.

Each image record has ``filepath`` (COCO only), ``filename``, ``split`` (train/val/test/restval),
``sentences`` with ``raw`` text, and ``cocoid`` (COCO) or ``imgid``. With ``restval_as_train`` the
COCO ``restval`` images join train (113,287 training images, the common practice); otherwise they
keep their own split code.
"""

from __future__ import annotations

from pathlib import Path

from ..store import SPLITS, FeatureStore
from .common import IngestError, IngestReport, read_json


def ingest_karpathy(json_path: str | Path, image_root: str | Path, store_path: str | Path, *,
                    restval_as_train: bool = False, strict: bool = False, check_files: bool = True,
                    overwrite: bool = False, dataset: str | None = None) -> tuple[FeatureStore, IngestReport]:
    json_path, image_root = Path(json_path), Path(image_root)
    doc = read_json(json_path)
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise IngestError(f"{json_path}: expected an object with an 'images' list (Karpathy format)")
    report = IngestReport(strict=strict)
    ids, paths, splits, texts, owners = [], [], [], [], []
    seen: dict[str, int] = {}
    for pos, rec in enumerate(doc["images"]):
        where = f"{json_path}: images[{pos}]"
        if not isinstance(rec, dict) or "filename" not in rec or "split" not in rec:
            raise IngestError(f"{where}: an image record needs 'filename' and 'split'")
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
        if check_files and not (image_root / rel).is_file():
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
        raise IngestError(f"{json_path}: no usable images")
    name = dataset or doc.get("dataset") or json_path.stem.replace("dataset_", "")
    with FeatureStore.building(store_path, overwrite=overwrite, dataset=name, image_root=image_root,
                               source_files=[str(json_path.resolve())]) as store:
        store.write_images(ids, paths, splits)
        store.write_captions(texts, owners)
        store.root.attrs["restval_as_train"] = bool(restval_as_train)
    report.counts = {"images": len(ids), "captions": len(texts)}
    return store, report
