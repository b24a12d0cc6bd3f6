"""WebDataset tar shards, as img2dataset and open_clip write them: one sample per key, its files
``KEY.jpg`` (or .jpeg/.png/.webp/...) and ``KEY.txt`` and/or ``KEY.json`` side by side.

A member's key and extension follow webdataset's own rule (``base_plus_ext``): the key is the
path up to the first dot of the file name, the extension the rest. Captions come from ``.txt``
(every non-empty line is one caption, so a sample may carry several, as clip_benchmark's COCO
shards do) or else from ``.json`` ``"caption"`` (a string) or ``"captions"`` (a list). The image id
is the key; keys must be unique across shards.

Images are not unpacked: an image's store path is ``shard.tar::KEY.jpg@OFFSET+SIZE`` (see
:mod:`.shards`), read back with one seek by extraction. Shards must be uncompressed tars (what
img2dataset writes); ``.tar.gz`` shards cannot be read in place and are refused. Splits come from a
split file (id → split), one ``split`` for everything, or a seeded random split by ``ratios``.

The store's image root is the shards' common folder (symlinks followed), so every shard lies under
it. A member name that would leave its shard's folder if unpacked (absolute, or with a ``..``
part) is refused unless ``allow_outside_root``, as every ingest refuses image paths outside its
root; symlink and hard-link members are never read (only regular files are images).
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path
from typing import Sequence

from ..base import ImageError
from ..store import FeatureStore, split_code
from .common import IngestError, IngestReport, read_split_file, write_containers
from .folder import assign_splits, parse_ratios
from . import remote
from .shards import tar_ref

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext


def expand_shards(patterns: Sequence[str | os.PathLike]) -> list:
    """Shard paths (local, or URLs on object storage: ``s3://b/{00000..00099}.tar``) from paths and
    brace patterns (``shard-{0000..0003}.tar``), in order."""
    from braceexpand import braceexpand

    out: list = []
    for pattern in patterns:
        for p in braceexpand(str(pattern)):
            path = Path(p)
            if remote.is_url(p):
                path = p
            elif "://" in p or p.startswith("pipe:"):
                raise IngestError(f"{p}: only local shard files or shards on object storage (s3://, az://, gs://) "
                                  f"can be ingested (images are read in place)")
            elif not path.is_file():
                raise IngestError(f"{path}: no such shard file")
            if os.path.splitext(str(path))[1].lower() in (".gz", ".tgz", ".bz2", ".xz", ".zst"):
                raise IngestError(f"{path}: compressed shards cannot be read in place; decompress them "
                                  f"to plain .tar first")
            out.append(path)
    if not out:
        raise IngestError("ingest webdataset: give at least one shard")
    if len(set(out)) != len(out):
        raise IngestError("ingest webdataset: a shard is named twice")
    return out


def _captions(shard, key: str, files: dict) -> list[str]:
    def read(ext):
        raw = files[ext]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IngestError(f"{shard}: {key}.{ext} is not UTF-8 text (byte {exc.start})") from None

    if "txt" in files:
        return [" ".join(line.split()) for line in read("txt").splitlines() if line.strip()]
    if "json" in files:
        try:
            doc = json.loads(read("json"))
        except json.JSONDecodeError as exc:
            raise IngestError(f"{shard}: {key}.json is malformed JSON ({exc.msg}, line {exc.lineno})") from None
        got = doc.get("captions", doc.get("caption")) if isinstance(doc, dict) else None
        got = [got] if isinstance(got, str) else got if isinstance(got, list) else []
        return [" ".join(str(c).split()) for c in got if str(c).strip()]
    return []


def _outside_name(name: str) -> str | None:
    """Why a member name leaves its shard's folder (absolute or ``..``), else None."""
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[/\\]", name):
        return "is an absolute path"
    if ".." in re.split(r"[/\\]", name):
        return "climbs out with '..'"
    return None


def scan_shard(shard, report: IngestReport, allow_outside_root: bool = False,
               fileobj=None) -> list[tuple[str, str, int, int, list[str]]]:
    """(key, image member, data offset, size, captions) of each usable sample of one shard, read
    once from start to end (``fileobj``: a stream of it, as a shard on object storage is read)."""
    try:
        tf = tarfile.open(shard if fileobj is None else None, mode="r|", fileobj=fileobj)
    except tarfile.ReadError as exc:
        raise IngestError(f"{shard}: not an uncompressed tar file ({exc})") from None
    samples: dict[str, dict] = {}   # key → extension → TarInfo (an image) or bytes (a caption file)
    with tf:
        try:
            for info in tf:
                if not info.isfile():
                    continue
                why = None if allow_outside_root else _outside_name(info.name)
                if why:
                    raise IngestError(f"{shard}: member name {info.name!r} {why}, outside the shard's folder; "
                                      f"refusing it (pass --allow-outside-root if this is intended)")
                m = _KEY.match(info.name)
                if not m:
                    continue
                ext = m.group(2).lower()   # stream mode: a caption file is read now, as it passes
                samples.setdefault(m.group(1), {})[ext] = tf.extractfile(info).read() if ext in ("txt", "json") else info
        except tarfile.TarError as exc:
            raise IngestError(f"{shard}: truncated or corrupt tar ({exc})") from None
        out = []
        for key, files in samples.items():
            if key.rsplit("/", 1)[-1].startswith("__"):  # webdataset metadata entries
                continue
            image = next((files[e] for e in IMAGE_EXTS if isinstance(files.get(e), tarfile.TarInfo)), None)
            if image is None:
                report.skip(f"{shard}: sample {key} has no image (.{', .'.join(IMAGE_EXTS[:4])}); "
                            f"members: {', '.join(sorted(files))}")
                continue
            caps = _captions(shard, key, files)
            if not caps:
                report.skip(f"{shard}: sample {key} has no caption (.txt, or .json caption/captions)")
                continue
            out.append((key, image.name, image.offset_data, image.size, caps))
    return out


def ingest_webdataset(shards: Sequence[str | os.PathLike], store_path: str | Path, *,
                      split_file: str | Path | None = None, split: str | None = None,
                      ratios: str | Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0, strict: bool = False,
                      overwrite: bool = False, drop_features: bool = False, dataset: str | None = None,
                      allow_outside_root: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Create a store whose images stay in ``shards`` (paths or brace patterns)."""
    paths = expand_shards(shards)
    if split is not None:
        split_code(split)
    ratios = parse_ratios(ratios)
    report = IngestReport(strict=strict)
    urls = [p for p in paths if isinstance(p, str)]
    if urls and len(urls) != len(paths):
        raise IngestError("ingest webdataset: give shards all on disk or all on object storage, not both")
    if urls:   # the shards' common folder on object storage; each shard streamed once, its size and ETag kept
        root = remote.common_root(urls)
        remote.check_root(root)
    else:
        root = Path(os.path.commonpath([str(p.resolve().parent) for p in paths]))
    ids, refs, texts, owners, where, objects = [], [], [], [], {}, {}
    for shard in paths:
        try:
            stream = remote.Stream(shard) if urls else None
        except ImageError as exc:
            raise IngestError(str(exc)) from None
        rel = shard[len(str(root)) + 1:] if urls else os.path.relpath(shard.resolve(), root)
        for key, member, offset, size, caps in scan_shard(shard, report, allow_outside_root, stream):
            if key in where:
                raise IngestError(f"{shard}: sample key {key} is also in {where[key]}; keys must be unique "
                                  f"across shards (they become image ids)")
            where[key] = shard
            texts += caps
            owners += [len(ids)] * len(caps)
            ids.append(key)
            refs.append(tar_ref(rel, member, offset, size))
        if stream is not None:
            objects[rel] = [int(stream.meta["size"]), stream.meta.get("e_tag")]
    if not ids:
        raise IngestError(f"{', '.join(map(str, paths[:3]))}: no usable samples")
    splits, ids, refs, texts, owners = _splits(ids, refs, texts, owners, split_file, split, ratios, seed, report)
    how = str(split_file) if split_file else split if split else {"ratios": list(ratios), "seed": int(seed)}
    return write_containers(store_path, report, "webdataset", paths, root, objects,
                            (ids, refs, splits, texts, owners), dataset, allow_outside_root,
                            overwrite=overwrite, drop_features=drop_features, attrs={"split_source": how})


def _splits(ids, refs, texts, owners, split_file, split, ratios, seed, report):
    """Each image's split; with a split file, images it does not name are skipped (and reported)."""
    if split is not None:
        return [split] * len(ids), ids, refs, texts, owners
    if split_file is None:
        return assign_splits(len(ids), ratios, seed), ids, refs, texts, owners
    table = read_split_file(split_file)
    keep = [i for i, k in enumerate(ids) if k in table]
    for i, k in enumerate(ids):
        if k not in table:
            report.skip(f"sample {k} has no split in {split_file}")
    if not keep:
        raise IngestError(f"{split_file}: names none of the samples' keys")
    new_row = {old: new for new, old in enumerate(keep)}
    cap_keep = [c for c, o in enumerate(owners) if o in new_row]
    return ([table[ids[i]] for i in keep], [ids[i] for i in keep], [refs[i] for i in keep],
            [texts[c] for c in cap_keep], [new_row[owners[c]] for c in cap_keep])
