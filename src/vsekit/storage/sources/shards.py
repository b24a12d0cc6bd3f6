"""Images that stay inside their container files: tar shards (webdataset) and parquet files.

A store image path of the form ``CONTAINER::ENTRY@LOCATION`` names an image inside a container
(relative to the store's ``image_root`` like any other image path)::

    shard-0003.tar::000000031.jpg@1536+2048   tar member 000000031.jpg: 2048 bytes at byte 1536
    part-0.parquet::jpg@17                    row 17 of the binary column ``jpg``
    part-0.parquet::image.bytes@17            row 17 of the ``bytes`` field of a struct column ``image``

Tar members are read with one seek and one read at the data offset recorded at ingest (tarfile's
``offset_data``); the 512-byte header before the data is checked against the member's size and name
so that a shard rewritten since ingest is reported, not decoded as some other image. Parquet cells
are read one row group of one column at a time; each process keeps the last row group it read, so
reading rows in store order (as extraction's row blocks do) reads every row group once. A parquet
file on object storage is read the same way, by pyarrow over ranged GETs (:class:`.remote.Ranged`):
its footer once per process, then each row group's column chunk.
"""

from __future__ import annotations

import tarfile
from functools import lru_cache
from pathlib import Path

from ..base import ImageError

SEP = "::"
CONTAINERS = (".tar", ".parquet")


def tar_ref(shard: str, member: str, offset: int, size: int) -> str:
    return f"{shard}{SEP}{member}@{int(offset)}+{int(size)}"


def parquet_ref(file: str, column: str, row: int) -> str:
    return f"{file}{SEP}{column}@{int(row)}"


def is_ref(path: str | Path) -> bool:
    """Is ``path`` an in-container reference (not a plain image file)?"""
    text = str(path)
    if SEP not in text:
        return False
    container, _, rest = text.rpartition(SEP)
    return container.lower().endswith(CONTAINERS) and "@" in rest


def parse_ref(path: str | Path) -> tuple[str, str, str]:
    """``CONTAINER::ENTRY@LOCATION`` → (container, entry, location); ValueError if malformed."""
    text = str(path)
    container, _, rest = text.rpartition(SEP)
    entry, _, location = rest.rpartition("@")
    if not container or not entry or not location:
        raise ValueError(f"{text}: not an in-container image reference (CONTAINER::ENTRY@LOCATION)")
    return container, entry, location


def read_bytes(path: str | Path, where=None) -> bytes:
    """The encoded image bytes a reference points at (a container on disk; a tar shard on object
    storage: :func:`.remote.fetch`; a parquet file there: ``where``, a :class:`.remote.Where`)."""
    container, entry, location = parse_ref(path)
    if where is None and not Path(container).is_file():
        raise ImageError(f"missing container file {container} (for {entry})")
    if container.lower().endswith(".tar"):
        try:
            offset, size = (int(x) for x in location.split("+"))
        except ValueError:
            raise ImageError(f"{path}: malformed tar location {location!r} (OFFSET+SIZE)") from None
        return _read_tar_member(container, entry, offset, size)
    try:
        row = int(location)
    except ValueError:
        raise ImageError(f"{path}: malformed parquet row {location!r}") from None
    return _read_parquet_cell(container, entry, row, where)


def _read_tar_member(shard: str, member: str, offset: int, size: int) -> bytes:
    with open(shard, "rb") as f:
        f.seek(max(0, offset - tarfile.BLOCKSIZE))
        head = f.read(tarfile.BLOCKSIZE) if offset >= tarfile.BLOCKSIZE else b""
        data = f.read(size)
    return check_member(shard, member, offset, size, head, data)


def check_member(shard: str, member: str, offset: int, size: int, head: bytes, data: bytes) -> bytes:
    """``data``, if ``head`` (the 512 bytes before it) is the header of ``member`` of ``size`` bytes;
    else ImageError: the shard changed since it was ingested."""
    try:
        info = tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape") if head else None
    except tarfile.TarError:
        info = None
    # long or non-ASCII names live in a pax header before this one, which holds a mangled copy
    long_name = len(member.encode()) > 99 or not member.isascii()
    name_ok = info is not None and (info.name == member or long_name)
    if not name_ok or info.size != size or len(data) != size:
        raise ImageError(f"{shard}: member {member} is not at byte {offset} ({size} bytes) any more; "
                         f"the shard changed since it was ingested (ingest it again)")
    return data


def _parquet(file: str, where=None):
    """A parquet file opened by pyarrow: by path, or on object storage (``where``: a hashable
    :class:`.remote.Where`) by ranged GETs, kept open for the next rows."""
    import pyarrow.parquet as pq

    return _remote_parquet(file, where) if where is not None else pq.ParquetFile(file)


@lru_cache(maxsize=4)
def _remote_parquet(file: str, where):
    import pyarrow.parquet as pq

    return pq.ParquetFile(where.reader(file))


@lru_cache(maxsize=16)
def _parquet_layout(file: str, where=None) -> tuple[int, ...]:
    """Cumulative row counts of a parquet file's row groups (first row of each, then the total)."""
    meta = _parquet(file, where).metadata
    starts = [0]
    for g in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(g).num_rows)
    return tuple(starts)


@lru_cache(maxsize=1)
def _row_group_column(file: str, column: str, group: int, where=None):
    """One row group of one column (a struct field as ``column.field``), as a pyarrow array."""
    top, _, field = column.partition(".")
    arr = _parquet(file, where).read_row_group(group, columns=[top]).column(top).combine_chunks()
    return arr.field(field) if field else arr


def _read_parquet_cell(file: str, column: str, row: int, where=None) -> bytes:
    from bisect import bisect_right

    starts = _parquet_layout(file, where)
    if not 0 <= row < starts[-1]:
        raise ImageError(f"{file}: row {row} is outside its {starts[-1]} rows; the file changed since "
                         f"it was ingested (ingest it again)")
    group = bisect_right(starts, row) - 1
    try:
        value = _row_group_column(file, column, group, where)[row - starts[group]].as_py()
    except KeyError:
        raise ImageError(f"{file}: no column {column!r} any more; the file changed since it was ingested") from None
    if not value:
        raise ImageError(f"{file}: row {row} has no image bytes in column {column!r}")
    return bytes(value)
