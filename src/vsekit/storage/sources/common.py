"""What every ingester shares: reading JSON with positions in errors, and the skip report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..base import ImageError
from ..store import DONE, FAILED, FeatureStore, StoreError
from . import remote


class IngestError(StoreError):
    """Input that cannot be ingested; the message names the file and the line or row."""


@dataclass
class IngestReport:
    """What an ingest did and what it skipped. With ``strict`` a skip is an error instead."""

    strict: bool = False
    skipped: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def skip(self, message: str) -> None:
        if self.strict:
            raise IngestError(f"{message} (--strict turns skips into errors)")
        self.skipped.append(message)

    def summary(self) -> str:
        parts = [f"{v} {k}" for k, v in self.counts.items()]
        text = "ingested " + ", ".join(parts) if parts else "ingested nothing"
        if self.skipped:
            shown = "\n  ".join(self.skipped[:20])
            more = f"\n  ... and {len(self.skipped) - 20} more" if len(self.skipped) > 20 else ""
            text += f"\nskipped {len(self.skipped)}:\n  {shown}{more}"
        return text


def write_store(store_path: str | Path, report: IngestReport, ids: list, paths: list, splits: list, texts: list,
                owners: list, attrs: dict, counts: dict | None = None, **building: Any) -> tuple[FeatureStore, IngestReport]:
    """Build the store of a captioned-image ingest (``building``: :meth:`FeatureStore.building`'s
    arguments): its images, captions and root ``attrs``; the report counts what went in."""
    with FeatureStore.building(store_path, **building) as store:
        store.write_images(ids, paths, splits)
        store.write_captions(texts, owners)
        store.root.attrs.update(attrs)
    report.counts = {"images": len(ids), "captions": len(texts), **(counts or {})}
    return store, report


def write_containers(store_path: str | Path, report: IngestReport, source: str, paths: list, root: Any,
                     objects: dict, rows: tuple, dataset: str | None, allow_outside_root: bool,
                     **building: Any) -> tuple[FeatureStore, IngestReport]:
    """:func:`write_store` for images inside container files (``source``: webdataset shards, parquet
    files) on disk or on object storage (``root`` a URL: kept as given, with each file's size and
    ETag in ``objects``, which extraction reads with If-Match)."""
    urls = [p for p in paths if isinstance(p, str)]
    name = dataset or (root.rsplit("/", 1)[-1] if urls else paths[0].parent.name) or source
    attrs = {"image_root": root, "image_objects": objects} if urls else {}
    attrs.update(building.pop("attrs", {}), image_source=source, allow_outside_root=bool(allow_outside_root))
    return write_store(store_path, report, *rows, attrs, {"files" if source == "parquet" else "shards": len(paths)},
                       dataset=name, image_root="" if urls else root,
                       source_files=urls or [str(p.resolve()) for p in paths], **building)


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.exists():
        raise IngestError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise IngestError(f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise IngestError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def karpathy_image_id(rec: dict) -> str:
    """The id a Karpathy image record gets in a store: ``cocoid``, else ``imgid``, else the filename stem."""
    return str(rec.get("cocoid", rec.get("imgid", Path(str(rec.get("filename", ""))).stem)))


def read_split_file(path: str | Path) -> dict[str, str]:
    """Read an image-id → split assignment.

    Accepted forms: a Karpathy split JSON (``{"images": [{"cocoid"|"imgid", "split"}...]}``), a JSON
    object ``{image_id: split}``, or a text file of ``image_id<TAB>split`` lines (a ``,`` also works
    as the separator; blank lines and ``#`` comments are ignored).
    """
    from ..store import SPLITS

    path = Path(path)
    if not path.exists():
        raise IngestError(f"{path}: no such file")
    out: dict[str, str] = {}

    def put(key: Any, split: Any, where: str) -> None:
        key, split = str(key).strip(), str(split).strip()
        if split not in SPLITS:
            raise IngestError(f"{where}: unknown split {split!r}; valid: {', '.join(SPLITS)}")
        if key in out and out[key] != split:
            raise IngestError(f"{where}: image id {key} is assigned twice ({out[key]} and {split})")
        out[key] = split

    head = path.read_bytes()[:1].strip() or b""
    if path.suffix.lower() == ".json" or head in (b"{", b"["):
        doc = read_json(path)
        if isinstance(doc, dict) and isinstance(doc.get("images"), list):
            for pos, rec in enumerate(doc["images"]):
                if not isinstance(rec, dict) or "split" not in rec:
                    raise IngestError(f"{path}: images[{pos}] has no 'split'")
                put(karpathy_image_id(rec), rec["split"], f"{path}: images[{pos}]")
        elif isinstance(doc, dict):
            for key, split in doc.items():
                put(key, split, f"{path}: key {key!r}")
        else:
            raise IngestError(f"{path}: expected a Karpathy JSON or an object {{image_id: split}}")
        return out
    for lineno, line in enumerate(map(str.strip, read_text_lines(path)), 1):
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t") if "\t" in line else line.split(",")
        if len(parts) != 2:
            raise IngestError(f"{path}:{lineno}: expected 'image_id<TAB>split', got {line[:80]!r}")
        if lineno == 1 and parts[1].strip() == "split":  # a header line
            continue
        put(parts[0], parts[1], f"{path}:{lineno}")
    return out


def read_text_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file without their line ends; errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise IngestError(f"{path}: no such file")
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                out.append(raw.decode("utf-8").rstrip("\r\n"))
            except UnicodeDecodeError as exc:
                raise IngestError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start})") from None
    return out


def outside_root(image_root: str | Path, rel: str) -> str | None:
    """Why ``rel`` leaves ``image_root`` (absolute, ``..``, or a symlink pointing out), else None.

    A dataset file from elsewhere must not make vsekit read arbitrary files of the machine; the
    final path is resolved (symlinks followed) and must stay under the resolved root.
    """
    if Path(rel).is_absolute() or rel.startswith(("/", "\\")):
        return "is an absolute path"
    if remote.is_url(image_root):   # no symlinks on object storage: the name alone
        return "climbs out with '..'" if ".." in rel.replace("\\", "/").split("/") else None
    return escapes_root(image_root, Path(image_root) / rel)


def escapes_root(image_root: str | Path, path: str | Path) -> str | None:
    """Why the file ``path`` (under ``image_root`` by name) really lies outside it once every ``..``
    and symlink is resolved, else None. Extract asks again when it opens the file, so an image
    replaced by a symlink pointing out after the ingest is not read either."""
    root = Path(image_root).resolve()
    target = Path(path).resolve()
    if target != root and root not in target.parents:
        return f"resolves to {target}, outside the image root {root}"
    return None


def check_inside_root(image_root: str | Path, rel: str, where: str, allow_outside: bool) -> None:
    """Refuse an image path outside the root unless ``allow_outside`` (``--allow-outside-root``)."""
    if allow_outside:
        return
    why = outside_root(image_root, rel)
    if why:
        raise IngestError(f"{where}: image path {rel!r} {why}; refusing to read files outside the "
                          f"image root (pass --allow-outside-root if this is intended)")


def no_images_error(source: str | Path, image_root: str | Path, looked_for: Path | None) -> IngestError:
    """The error for an ingest that found no image files: name the path it looked for."""
    if looked_for is None:
        return IngestError(f"{source}: no usable images")
    return IngestError(f"{source}: no usable images: no image file was found under the image root "
                       f"{image_root if remote.is_url(image_root) else Path(image_root).resolve()} (looked for "
                       f"e.g. {looked_for}); check --image-root")


class ImageRoot:
    """An ingest's image root: a folder, or a URL on object storage whose objects are listed once
    (:func:`.remote.listing`), never probed one by one. ``root / rel`` is an image's location."""

    def __init__(self, root: str | Path):
        self.root = str(root) if remote.is_url(root) else Path(root)
        self._listed: dict | None = None

    def __truediv__(self, rel: str):
        return remote.join(self.root, rel) if isinstance(self.root, str) else self.root / rel

    def __str__(self) -> str:
        return str(self.root)

    def exists(self, rel: str) -> bool:
        if not isinstance(self.root, str):
            return (self.root / rel).is_file()
        if self._listed is None:
            try:
                self._listed = remote.listing(self.root)
            except ImageError as exc:
                raise IngestError(f"--image-root {exc}") from None
        return rel in self._listed

    @property
    def local(self):
        """The root for :meth:`FeatureStore.building` (a URL is recorded by :meth:`attrs` instead)."""
        return "" if isinstance(self.root, str) else self.root

    def attrs(self, allow_outside_root: bool, **more: Any) -> dict:
        """The store's root attrs: a URL root kept as given (the store's create resolves a folder), and
        ``allow_outside_root`` (extract checks image paths again unless it is set)."""
        url = {"image_root": remote.public_url(self.root).rstrip("/")} if isinstance(self.root, str) else {}
        return {**url, **more, "allow_outside_root": bool(allow_outside_root)}


class RegionBlock:
    """One row block of a padded regions set being filled (ingest butd / npz): every row starts
    failed, ``put`` fills one image's regions and marks it done, ``write`` stores the block."""

    def __init__(self, fs, block):
        n, k, width = len(block), fs.shape[1], fs.shape[2]
        self.block = block
        self.data = np.zeros((n, k, width), dtype=fs.data.dtype)
        self.boxes = np.zeros((n, k, 4), dtype=np.float32)
        self.count = np.zeros(n, dtype=np.int16)
        self.size = np.zeros((n, 2), dtype=np.int32)
        self.status = np.full(n, FAILED, dtype=np.uint8)

    def put(self, row: int, feats, boxes, width: int, height: int) -> None:
        i, nb = row - self.block.start, len(boxes)
        self.data[i, :nb], self.boxes[i, :nb], self.count[i], self.size[i] = feats, boxes, nb, (width, height)
        self.status[i] = DONE

    def failed_rows(self) -> list[int]:
        return [self.block.start + int(i) for i in np.flatnonzero(self.status == FAILED)]

    def write(self, fs) -> None:
        fs.write_block(self.block, self.data, status=self.status, boxes=self.boxes, count=self.count,
                       image_size=self.size)
