"""Parquet tables of captioned images: img2dataset's parquet output and Hugging Face datasets exports.

One row is an image with one caption (a string column) or several (a list-of-strings column).
Rows that share an image id add captions to that image (caption-per-row exports). The image is
one of:

* a binary column (img2dataset's ``jpg``): the bytes stay in the file; the store path is
  ``file.parquet::jpg@ROW`` (see :mod:`.shards`), read in place by extraction;
* a struct column with ``bytes`` and ``path`` fields (the HF ``Image`` feature): ``bytes`` when
  present (``file.parquet::image.bytes@ROW``), else ``path``;
* a string column of paths, relative to ``image_root`` (default: the first file's folder).

An image path (a path column, or an HF struct's ``path``) must lead to a file under the image root
once symlinks are followed; an absolute path inside the root is stored relative to it. A path that
leaves the root (absolute elsewhere, ``../``, a symlink out) is refused unless
``allow_outside_root``. When no row is usable because no image file was found, the error names a
few of the paths looked for and points at ``--image-root``.

Columns are found by name unless given (``--image-column`` ...). The image id is the id column, else
the image path without its extension, else ``FILE:ROW``. Splits come from a split column (values
train, val, test, restval), a split file, one ``split``, or a seeded random split. Files are read one
row group at a time (the image column of one row group is read to see which rows hold an image,
then dropped), so memory is bounded by a row group, never by the file.
"""

from __future__ import annotations

import os
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from ..base import ImageError
from ..store import SPLITS, FeatureStore, split_code
from . import remote
from .common import IngestError, IngestReport, write_containers
from .folder import parse_ratios
from .shards import parquet_ref
from .webdataset import _splits

IMAGE_COLUMNS = ("jpg", "png", "webp", "image", "img", "image_bytes", "image_path", "filepath", "path",
                 "file_name", "filename")
CAPTION_COLUMNS = ("caption", "captions", "sentences", "text", "txt")
ID_COLUMNS = ("key", "image_id", "id", "cocoid", "img_id", "imgid")


def expand_files(items: Sequence[str | os.PathLike]) -> list:
    """Parquet files (paths; URLs on object storage, a glob there matched against one listing of its
    folder) from paths, folders and brace patterns, in order."""
    from braceexpand import braceexpand

    out: list = []
    for item in items:
        for p in braceexpand(str(item)):
            path = Path(p)
            folder, _, name = p.rpartition("/")
            if remote.is_url(p) and (not name or any(c in name for c in "*?[")):   # a folder or a glob
                found = sorted(f"{folder}/{k}" for k in remote.listing(folder)
                               if "/" not in k and fnmatch(k, name or "*.parquet"))
                if not found:
                    raise IngestError(f"{p}: no parquet file matches it")
                out += found
            elif remote.is_url(p):   # one file, read at ingest
                out.append(p)
            elif path.is_dir():
                found = sorted(path.glob("*.parquet"))
                if not found:
                    raise IngestError(f"{path}: no .parquet files in this folder")
                out += found
            elif path.is_file():
                out.append(path)
            else:
                raise IngestError(f"{path}: no such parquet file")
    return out


def _pick(schema, given: str | None, choices: Sequence[str], what: str, option: str, file: Path) -> str | None:
    names = list(schema.names)
    if given is not None:
        if given not in names:
            raise IngestError(f"{file}: no column {given!r} ({option}); it has: {', '.join(names)}")
        return given
    return next((c for c in choices if c in names), None)


def _image_kind(field, file: Path) -> str:
    import pyarrow as pa

    t = field.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "path"
    if pa.types.is_struct(t) and t.get_field_index("bytes") >= 0:
        return "struct"
    raise IngestError(f"{file}: image column {field.name!r} has type {t}; expected binary image bytes, "
                      f"a path string, or a struct with 'bytes' and 'path' (HF Image)")


def _caption_list(value: Any) -> list[str]:
    got = [value] if isinstance(value, str) else list(value or [])
    out = []
    for c in got:
        if isinstance(c, dict):  # Karpathy-style sentences: {"raw": ..., "tokens": ...}
            c = c.get("raw", "")
        text = " ".join(str(c).split())
        if text:
            out.append(text)
    return out


def ingest_parquet(files: Sequence[str | os.PathLike], store_path: str | Path, *, image_column: str | None = None,
                   caption_column: str | None = None, id_column: str | None = None,
                   split_column: str | None = None, image_root: str | os.PathLike | None = None,
                   check_files: bool = True, split_file: str | Path | None = None, split: str | None = None,
                   ratios: str | Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0, strict: bool = False,
                   overwrite: bool = False, drop_features: bool = False, dataset: str | None = None,
                   allow_outside_root: bool = False) -> tuple[FeatureStore, IngestReport]:
    """Create a store from parquet files; image bytes are referenced in place, not copied."""
    import pyarrow.parquet as pq

    paths = expand_files(files)
    if split is not None:
        split_code(split)
    ratios = parse_ratios(ratios)
    report = IngestReport(strict=strict)
    urls = [p for p in paths if isinstance(p, str)]   # on object storage: each file read whole, once
    if urls:
        if len(urls) != len(paths) or image_root:
            raise IngestError("ingest parquet: give files all on disk or all on object storage (their image "
                              "bytes inside them: no --image-root)")
        root = remote.common_root(urls)
        remote.check_root(root)
    else:
        root = Path(image_root).resolve() if image_root else paths[0].resolve().parent
    paths_to = _ImagePaths(root, image_root is not None, allow_outside_root, check_files, report)
    row_of: dict[str, int] = {}
    ids, refs, given, texts, owners, objects = [], [], [], [], [], {}
    for file in paths:
        try:
            if urls:
                import pyarrow as pa

                data, meta = remote.get(file)
                objects[file[len(root) + 1:]] = [int(meta["size"]), meta.get("e_tag")]
            pf = pq.ParquetFile(pa.BufferReader(data) if urls else file)
        except (ImageError, FileNotFoundError) as exc:
            why = "no such object" if isinstance(exc, FileNotFoundError) else exc
            raise IngestError(f"{file}: cannot read it: {why}") from None
        except Exception as exc:  # pyarrow raises several types for a non-parquet file
            raise IngestError(f"{file}: not a parquet file ({exc})") from None
        schema = pf.schema_arrow
        img_col = _pick(schema, image_column, IMAGE_COLUMNS, "image", "--image-column", file)
        cap_col = _pick(schema, caption_column, CAPTION_COLUMNS, "caption", "--caption-column", file)
        if img_col is None or cap_col is None:
            raise IngestError(f"{file}: no {'image' if img_col is None else 'caption'} column found; name it "
                              f"with {'--image-column' if img_col is None else '--caption-column'} "
                              f"(columns: {', '.join(schema.names)})")
        id_col = _pick(schema, id_column, ID_COLUMNS, "id", "--id-column", file)
        split_col = _pick(schema, split_column, ("split",), "split", "--split-column", file)
        kind = _image_kind(schema.field(img_col), file)
        if urls and kind == "path":
            raise IngestError(f"{file}: image column {img_col!r} holds paths; parquet files on object storage "
                              f"are read with their image bytes inside them")
        rel_file = file[len(root) + 1:] if urls else os.path.relpath(file.resolve(), root)
        read_cols = [c for c in {cap_col, id_col, split_col} if c]
        if kind == "path":
            read_cols.append(img_col)
        start = 0
        for g in range(pf.metadata.num_row_groups):
            table = pf.read_row_group(g, columns=sorted(set(read_cols)))
            present = None
            if kind != "path":  # which rows have bytes (one row group's image column in memory)
                col = pf.read_row_group(g, columns=[img_col]).column(img_col).combine_chunks()
                present = _image_cells(col, kind)
                del col
            cols = {c: table.column(c).to_pylist() for c in table.column_names}
            for i in range(table.num_rows):
                row = start + i
                where = f"{file}: row {row}"
                if kind == "path" or (present[i] is not None and present[i][0] == "path"):
                    ref = paths_to.ref(cols[img_col][i] if kind == "path" else present[i][1], where, img_col)
                    if ref is None:
                        continue
                elif present[i] is None:
                    report.skip(f"{where}: no image bytes in column {img_col!r}")
                    continue
                else:
                    ref = parquet_ref(rel_file, img_col + (".bytes" if kind == "struct" else ""), row)
                if id_col:
                    image_id = str(cols[id_col][i])
                elif "::" not in ref:
                    image_id = str(PurePosixPath(ref).with_suffix(""))
                else:
                    image_id = f"{PurePosixPath(str(file)).stem}:{row}"
                s = cols[split_col][i] if split_col else None
                s = {"dev": "val"}.get(s, s)
                if split_col and s not in SPLITS:
                    raise IngestError(f"{where}: unknown split {s!r} in column {split_col!r}; "
                                      f"valid: {', '.join(SPLITS)}")
                caps = _caption_list(cols[cap_col][i])
                if image_id not in row_of:
                    if not caps:
                        report.skip(f"{where}: image {image_id} has no caption in column {cap_col!r}")
                        continue
                    row_of[image_id] = len(ids)
                    ids.append(image_id)
                    refs.append(ref)
                    given.append(s)
                r = row_of[image_id]
                if split_col and given[r] != s:
                    raise IngestError(f"{where}: image {image_id} is in split {s!r} here but {given[r]!r} "
                                      f"on an earlier row")
                texts += caps
                owners += [r] * len(caps)
            start += table.num_rows
    if not ids:
        raise paths_to.no_rows_error(f"{', '.join(map(str, paths[:3]))}")
    if split_col and split is None and split_file is None:
        splits = given
    else:
        splits, ids, refs, texts, owners = _splits(ids, refs, texts, owners, split_file, split, ratios, seed,
                                                   report)
    return write_containers(store_path, report, "parquet", paths, root, objects,
                            (ids, refs, splits, texts, owners), dataset, allow_outside_root,
                            overwrite=overwrite, drop_features=drop_features)


class _ImagePaths:
    """Image paths of a parquet table → store paths relative to the image root: refuses paths that
    leave the root (unless allowed), skips missing files, and remembers a few it looked for."""

    def __init__(self, root: Path, root_given: bool, allow_outside: bool, check_files: bool,
                 report: IngestReport):
        self.root, self.root_given, self.allow_outside = root, root_given, allow_outside
        self.check_files, self.report = check_files, report
        self.looked_for: list[Path] = []
        self.missing = 0
        self.column = ""

    def ref(self, raw: Any, where: str, column: str) -> str | None:
        """The store path of one row's image path, or None when the row is skipped."""
        if not raw:
            self.report.skip(f"{where}: empty image path")
            return None
        text = str(raw).replace("\\", "/")
        rel = self.inside(text)
        if rel is None:
            if not self.allow_outside:
                raise IngestError(f"{where}: image path {text!r} in column {column!r} "
                                  f"{_why_outside(self.root, text)}; refusing to read files outside the image "
                                  f"root (pass --image-root DIR for the folder that holds the images, or "
                                  f"--allow-outside-root if this is intended)")
            rel = PurePosixPath(text).as_posix()
        if self.check_files and not (self.root / rel).is_file():
            self.missing += 1
            self.column = column
            if len(self.looked_for) < 3:
                self.looked_for.append(self.root / rel)
            self.report.skip(f"{where}: image file {self.root / rel} is missing")
            return None
        return rel

    def inside(self, text: str) -> str | None:
        """``text`` relative to the root when, with symlinks followed, it names a path under the root."""
        path = Path(text)
        target = (self.root / path).resolve()
        if target != self.root and self.root not in target.parents:
            return None
        if not path.is_absolute():
            return PurePosixPath(text).as_posix()
        try:  # keep the given name when it is spelled under the root
            lexical = PurePosixPath(path.relative_to(self.root).as_posix())
            if ".." not in lexical.parts:
                return lexical.as_posix()
        except ValueError:
            pass
        return target.relative_to(self.root).as_posix()

    def no_rows_error(self, files: str) -> IngestError:
        """The error when no row was usable; names the image files looked for when that is why."""
        if not self.missing:
            return IngestError(f"{files}: no usable rows")
        tried = ", ".join(map(str, self.looked_for)) + (", ..." if self.missing > len(self.looked_for) else "")
        hint = ("check --image-root" if self.root_given
                else "pass --image-root DIR, the folder they are relative to (default: the first file's folder)")
        return IngestError(f"{files}: no usable rows: none of the {self.missing} image paths in column "
                           f"{self.column!r} names a file under the image root {self.root} (looked for "
                           f"{tried}); {hint}")


def _why_outside(root: Path, text: str) -> str:
    target = (root / text).resolve()
    what = "is an absolute path" if Path(text).is_absolute() else "leaves the image root"
    return f"{what} that resolves to {target}, outside the image root {root}"


def _image_cells(col, kind: str) -> list[tuple[str, str | None] | None]:
    """Per row: ("bytes", None) when it holds image bytes, ("path", p) for an HF struct with only a
    path, None when it has neither (img2dataset's failed downloads)."""
    out: list[tuple[str, str | None] | None] = []
    if kind == "bytes":
        return [("bytes", None) if v.is_valid and len(v.as_buffer() or b"") else None for v in col]
    data = col.field("bytes")
    paths = col.field("path") if col.type.get_field_index("path") >= 0 else None
    for i in range(len(col)):
        if not col[i].is_valid:
            out.append(None)
        elif data[i].is_valid and len(data[i].as_buffer() or b""):
            out.append(("bytes", None))
        elif paths is not None and paths[i].is_valid and paths[i].as_py():
            out.append(("path", paths[i].as_py()))
        else:
            out.append(None)
    return out
