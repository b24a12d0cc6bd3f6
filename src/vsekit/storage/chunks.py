"""Reading a feature set's rows block by block with every chunk file checked: the store side of the
trainer's loader (``train/data.py``) and of evaluation.

``ChunkReader(fs)`` takes the set's checksums, status and generation once (``integrity.BlockCheck``).
Then each block is either

- read raw: an uncompressed float32 Zarr v3 array in a local directory store (codecs: little-endian
  ``bytes`` only, no sharding, one chunk per row block) keeps each block's rows in C order in one
  file, so ``read_raw`` reads the file straight into the caller's buffer and computes its CRC-32 on
  the way (one copy from the page cache instead of zarr's read, decode and copy); or
- checked by ``verify`` (each chunk file is read once more for its CRC-32) before zarr decodes it.

Either way nothing is used from a block whose files differ from the record, and ``check_generation``
after the read refuses rows of a set made again (``--overwrite``) meanwhile. Setting ``check`` to
None turns the checks off (the loader benchmark's baseline).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .base import StoreError
from .integrity import ABSENT, BlockCheck, crc_of

if TYPE_CHECKING:
    from .store import FeatureSet


class ChunkReader:
    """Checked block reads of one feature set's ``data`` array (and its per-row ``count``, if any)."""

    def __init__(self, fs: "FeatureSet"):
        self.fs = fs
        self.chunk_rows = fs.chunk_rows
        self.n_rows = fs.n_rows
        self.has_count = fs.has_array("count")
        self.check: BlockCheck | None = BlockCheck(fs, ("data", "count"))
        self._layout: tuple[str, Callable] | None | bool = False   # False: not looked at yet

    def verify(self, start: int, stop: int) -> None:
        """Check every block overlapping rows ``[start, stop)`` (data and counts) before zarr decodes them."""
        if self.check is None or stop <= start:
            return
        for index in range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1):
            self.check.check_file(index, "data")
            if self.has_count:
                self.check.check_file(index, "count")

    def check_generation(self) -> None:
        """After a read: refuse rows of a set made again (``--overwrite``) since the reader opened it."""
        if self.check is not None:
            self.check.check_generation()

    def raw_file(self, start: int, stop: int) -> str | None:
        """Path of the chunk file holding exactly rows ``[start, stop)`` when its bytes are the rows
        (raw little-endian float32, see the module docstring), else None (read through zarr)."""
        if self._layout is False:
            self._layout = raw_layout(self.fs.data)
        if self._layout is None or start % self.chunk_rows or stop != min(start + self.chunk_rows, self.n_rows):
            return None
        root, encode = self._layout
        return os.path.join(root, encode((start // self.chunk_rows,) + (0,) * (self.fs.data.ndim - 1)))

    def read_raw(self, path: str, start: int, out: np.ndarray) -> None:
        """Read the raw chunk file ``path`` (of the block starting at row ``start``) into ``out``,
        computing its CRC-32 on the way (an edge chunk's padding is read too), and refuse the block
        if it differs from the record; the block's ``count`` file is checked as well."""
        check = self.check
        index = start // self.chunk_rows
        if check is None or check.expected(index, "data") is None:
            read_chunk_file(path, out)
        else:
            crc, size = read_chunk_file(path, out, crc=True)
            check.check_sum(index, "data", crc, size)
        if self.has_count and check is not None:
            check.check_file(index, "count")


def raw_layout(array: Any) -> tuple[str, Callable] | None:
    """(array folder, chunk-key encoder) if ``array``'s chunk files are raw little-endian float32 rows."""
    try:
        from zarr.codecs import BytesCodec
        from zarr.storage import LocalStore

        meta = array.metadata
        store = array.store_path.store
        raw = (getattr(meta, "zarr_format", 3) == 3 and isinstance(store, LocalStore)
               and array.dtype == np.dtype("<f4") and len(meta.codecs) == 1
               and isinstance(meta.codecs[0], BytesCodec) and str(getattr(meta.codecs[0].endian, "value", "")) == "little"
               and getattr(array, "shards", None) is None and tuple(array.chunks[1:]) == tuple(array.shape[1:])
               and float(array.fill_value) == 0.0)
        if not raw:
            return None
        folder = os.path.join(str(store.root), *array.store_path.path.split("/"))
        encoder = meta.chunk_key_encoding.encode_chunk_key
        return folder, lambda coords: encoder(coords).replace("/", os.sep)
    except Exception:  # another zarr layout or version: zarr reads it
        return None


def read_chunk_file(path: str, out: np.ndarray, crc: bool = False) -> tuple[int, int]:
    """Read a raw chunk file's first ``out.nbytes`` bytes into ``out``; a missing chunk is all fill (0).

    With ``crc``, returns the CRC-32 and size of the whole file (size ``ABSENT``: missing), else (0, 0).
    """
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:  # never written: zarr's fill value
        out.fill(0)
        return 0, ABSENT
    with f:
        view = memoryview(out).cast("B")
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                if crc:   # the caller reports it against the recorded size
                    return 0, got
                raise StoreError(f"{path}: chunk file is {got} bytes, expected at least {len(view)}; "
                                 f"the store is damaged")
            got += n
        if not crc:
            return 0, 0
        value = crc_of(view)
        while tail := f.read(1 << 20):   # the padding of an edge chunk
            value = crc_of(tail, value)
            got += len(tail)
        return value, got
