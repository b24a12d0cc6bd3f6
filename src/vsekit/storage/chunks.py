"""Reading a feature set's rows block by block with every chunk checked against its record before
its rows are used: the store side of the trainer's loader (``train/data.py``) and of evaluation.

A raw float32 chunk file on a disk is read straight into the caller's buffer with its CRC-32 computed
on the way (:meth:`ChunkReader.read_raw`); any other chunk is checked (``verify``) before zarr
decodes it; on object storage each block is one GET per array, checked and decoded from those same
bytes (:meth:`ChunkReader.read_rows`), with ``read_requests`` reads in flight. ``check = None`` turns
the checks off (the loader benchmark's baseline). Why and how: docs/train.md, docs/store.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .base import StoreError
from .integrity import ABSENT, BlockCheck, crc_of

if TYPE_CHECKING:
    from .store import FeatureSet

#: chunk reads in flight from a store on object storage (the ``read_requests`` storage option):
#: enough to hide a provider's ~10-100 ms first-byte latency behind a GPU step
READ_REQUESTS = 16


class ChunkReader:
    """Checked block reads of one feature set's ``data`` array (and its per-row ``count``, if any)."""

    def __init__(self, fs: "FeatureSet"):
        self.fs = fs
        self.chunk_rows = fs.chunk_rows
        self.n_rows = fs.n_rows
        self.has_count = fs.has_array("count")
        self.check: BlockCheck | None = BlockCheck(fs, ("data", "count"))
        self._layout: tuple[str, Callable] | None | bool = False   # False: not looked at yet
        objects = fs.store.objects
        self.remote = objects is not None
        self.requests = 1
        if self.remote:
            value = objects.options.get("read_requests", READ_REQUESTS)
            try:
                self.requests = int(value)
            except ValueError:
                self.requests = 0
            if self.requests < 1:
                raise ValueError(f"--storage-option read_requests must be a whole number of at least 1, "
                                 f"got {value!r}")
            self._decoders: dict = {}
            # opened once here (each opening reads the array's metadata object), not per block
            self._arrays = {"data": fs.data, **({"count": fs.array("count")} if self.has_count else {})}

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
            self._layout = None if self.remote else raw_layout(self.fs.data)
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

    # object storage ----------------------------------------------------------------------------
    def fetch(self, index: int, array: str) -> bytes | None:
        """Block ``index``'s chunk object of ``array`` in one GET, refused unless it matches the block's
        commit record (CRC-32 and size); None when zarr never wrote it (all fill)."""
        got = self.fs.store.objects.get(self._key(array, index))
        payload = None if got is None else got[0]
        if self.check is not None:
            size = ABSENT if payload is None else len(payload)
            self.check.check_sum(index, array, 0 if payload is None else crc_of(payload), size)
        return payload

    def read_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows ``[start, stop)`` of ``data`` as stored (and their ``count``, or None), each block
        fetched once and checked (:meth:`fetch`) before it is decoded. Object storage only."""
        parts, counts = [], []
        for index in range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1) if stop > start else ():
            b0 = index * self.chunk_rows
            b1 = min(b0 + self.chunk_rows, self.n_rows)
            lo, hi = max(start, b0) - b0, min(stop, b1) - b0
            parts.append(self._decode("data", self.fetch(index, "data"), b1 - b0)[lo:hi])
            if self.has_count:
                counts.append(self._decode("count", self.fetch(index, "count"), b1 - b0)[lo:hi])
        data = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else \
            np.zeros((0, *self.fs.data.shape[1:]), dtype=self.fs.data.dtype)
        count = None if not self.has_count else (np.concatenate(counts) if counts else np.zeros(0, np.int64))
        return data, count

    def _key(self, name: str, index: int) -> str:
        """The object key of chunk ``index`` of array ``name`` (as :func:`.objcommit.chunk_key`)."""
        arr = self._arrays[name]
        return f"features/{self.fs.name}/{name}/{arr.metadata.encode_chunk_key((index,) + (0,) * (arr.ndim - 1))}"

    def _decode(self, name: str, payload: bytes | None, rows: int) -> np.ndarray:
        """The first ``rows`` rows of one chunk of array ``name`` from its stored bytes."""
        key = (name, rows)
        decoder = self._decoders.get(key)
        if decoder is None:
            decoder = self._decoders[key] = _ChunkDecoder(self._arrays[name], rows)
        return decoder(payload)


class _ChunkDecoder:
    """Decodes one stored chunk of ``array`` (its first ``rows`` rows): a raw little-endian chunk as a
    view of its bytes, any other codec chain by zarr over the bytes held in memory."""

    def __init__(self, array: Any, rows: int):
        import dataclasses

        self.array, self.rows = array, rows
        self.shape = (rows, *array.shape[1:])
        self.raw = raw_codecs(array)
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        if not self.raw:
            from zarr.core.buffer import default_buffer_prototype

            self.proto = default_buffer_prototype()
            meta = dataclasses.replace(array.metadata, shape=self.shape, attributes={})
            self.meta = meta.to_buffer_dict(self.proto)["zarr.json"]
            self.key = meta.encode_chunk_key((0,) * array.ndim)

    def __call__(self, payload: bytes | None) -> np.ndarray:
        if payload is None:   # never written: zarr's fill value
            return np.full(self.shape, self.array.fill_value, dtype=self.array.dtype)
        if self.raw:
            n = int(np.prod(self.shape))
            if len(payload) < n * self.array.dtype.itemsize:
                raise StoreError(f"a chunk object of {self.array.path} is {len(payload)} bytes, expected at least "
                                 f"{n * self.array.dtype.itemsize}; the store is damaged")
            return np.frombuffer(payload, dtype=self.dtype, count=n).reshape(self.shape)
        import zarr
        from zarr.storage import MemoryStore

        store = MemoryStore({"zarr.json": self.meta, self.key: self.proto.buffer.from_bytes(payload)})
        return np.asarray(zarr.open_array(store, mode="r")[...])


def raw_codecs(array: Any) -> bool:
    """Whether ``array``'s chunks hold its rows as plain little-endian bytes (one ``bytes`` codec, no
    sharding, whole rows per chunk), whatever store holds them."""
    try:
        from zarr.codecs import BytesCodec

        meta = array.metadata
        codec = meta.codecs[0] if len(meta.codecs) == 1 else None
        return (getattr(meta, "zarr_format", 3) == 3 and isinstance(codec, BytesCodec)
                and (array.dtype.itemsize == 1 or str(getattr(codec.endian, "value", "")) == "little")
                and array.dtype.byteorder in "<=|" and getattr(array, "shards", None) is None
                and tuple(array.chunks[1:]) == tuple(array.shape[1:]))
    except Exception:  # another zarr layout or version: zarr decodes it
        return False


def raw_layout(array: Any) -> tuple[str, Callable] | None:
    """(array folder, chunk-key encoder) if ``array``'s chunk files are raw little-endian float32 rows."""
    try:
        from zarr.storage import LocalStore

        store = array.store_path.store
        if not (isinstance(store, LocalStore) and array.dtype == np.dtype("<f4") and raw_codecs(array)
                and float(array.fill_value) == 0.0):
            return None
        folder = os.path.join(str(store.root), *array.store_path.path.split("/"))
        encoder = array.metadata.chunk_key_encoding.encode_chunk_key
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
