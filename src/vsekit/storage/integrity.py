"""Per-block checksums of a feature set's stored bytes: detect deleted, truncated or altered chunks.

A block's CRC-32 and size of each of its chunk files go into the set's ``blocksums`` array (one chunk
per block) before its status marks it done; :func:`verify` compares the files with them (``quick``:
sizes only), :func:`repair` marks damaged blocks pending, and :class:`BlockCheck` checks every chunk
a reader uses. On object storage the record is the block's commit record (:mod:`.objcommit`). What
each check guarantees: docs/reliability.md, "A damaged chunk".
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .base import PENDING, Block, StoreError
from .faults import point
from .remake import remake_command

if TYPE_CHECKING:  # pragma: no cover
    from .store import FeatureSet

SUMS = "blocksums"
UNRECORDED = -2   # fill value: no checksum recorded (block not written yet)
ABSENT = -1       # size of a chunk zarr did not store (all fill value)


def create_sums(group, arrays: Sequence[str], n_rows: int, block_rows: int) -> None:
    """The ``blocksums`` array of a new set: (blocks, 2 × arrays) int64, CRC and size per array."""
    n_blocks = max(1, -(-n_rows // max(1, block_rows)))
    group.create_array(SUMS, shape=(n_blocks, 2 * len(arrays)), dtype=np.int64,
                       chunks=(1, 2 * len(arrays)), fill_value=UNRECORDED)
    group.attrs["checksummed"] = list(arrays)


def _chunk_file(fs: "FeatureSet", array: str, index: int) -> Path:
    arr = fs.group[array]
    coords = (index,) + (0,) * (arr.ndim - 1)
    key = arr.metadata.encode_chunk_key(coords)
    return Path(fs.store.path) / "features" / fs.name / array / Path(*key.split("/"))


def file_sum(fs: "FeatureSet", array: str, index: int, crc: bool) -> tuple[int, int]:
    """On a disk: (CRC-32, size) of chunk ``index`` of ``array`` (``crc``: else 0 and a stat only)."""
    path = _chunk_file(fs, array, index)
    try:
        if not crc:
            return 0, path.stat().st_size
        value, size = 0, 0
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                value = zlib.crc32(chunk, value)
                size += len(chunk)
        return value, size
    except FileNotFoundError:
        return 0, ABSENT


def record(fs: "FeatureSet", block: "Block") -> None:
    """Record the checksums of ``block``'s chunk files (just written) in ``blocksums``."""
    names = fs.group.attrs.get("checksummed")
    if not names or not fs.has_array(SUMS):
        return  # the set lost its checksum records: damaged, and ``verify`` reports its blocks so
    row = []
    for name in names:
        row.extend(file_sum(fs, name, block.index, crc=True))
    fs.group[SUMS][block.index] = np.asarray(row, dtype=np.int64)


@dataclass
class Report:
    """What :func:`verify` found: damaged blocks with the reason, and blocks with nothing to check."""

    name: str
    blocks: int
    damaged: dict[int, str] = field(default_factory=dict)
    full: bool = True
    etags: dict[int, str | None] = field(default_factory=dict)   # object storage: the records as checked

    @property
    def ok(self) -> bool:
        return not self.damaged

    def summary(self, store_path: str | os.PathLike) -> str:
        how = "checksums" if self.full else "chunk sizes"
        if self.ok:
            return f"{self.name}: {self.blocks} blocks, {how} verified, no damage found"
        lines = [f"{self.name}: {len(self.damaged)} of {self.blocks} blocks are damaged:"]
        for i, why in sorted(self.damaged.items())[:20]:
            lines.append(f"  block {i}: {why}")
        if len(self.damaged) > 20:
            lines.append(f"  ... and {len(self.damaged) - 20} more")
        lines.append(f"repair: {repair_command(store_path, self.name)}")
        return "\n".join(lines)


def repair_command(store_path: str | os.PathLike, name: str) -> str:
    return (f"`vsekit info {store_path} {name} --verify --repair` (marks the damaged blocks pending), "
            f"then rerun the command that made {name!r} with the same options to rewrite them")


def status_block(fs: "FeatureSet", block: "Block") -> np.ndarray | str:
    try:
        return np.asarray(fs.status[block.start:block.stop])
    except Exception as exc:  # a truncated or garbled chunk: zarr's codec error
        return f"status chunk unreadable ({type(exc).__name__}: {exc})"


def verify(fs: "FeatureSet", *, quick: bool = False) -> Report:
    """Check every finished block of ``fs`` against its records (see module doc): on a disk its
    checksums, on object storage its commit record; the store's :class:`~.sets.SetStorage` gives the
    records (``recorded``) and the chunks' sums (``chunk_sum``)."""
    sets = fs.store.sets
    blocks = fs.blocks()
    report = Report(fs.name, len(blocks), full=not quick)
    recorded = sets.recorded(fs, report.etags)   # with the ETags it saw: a repair voids only those records
    for b in blocks:
        rows = f" (rows {b.start}-{b.stop - 1})"
        status = status_block(fs, b)
        if isinstance(status, str):
            report.damaged[b.index] = f"{status}{rows}"
            continue
        if np.any(status > 2):
            report.damaged[b.index] = (f"status chunk holds invalid codes {sorted(set(status[status > 2].tolist()))}"
                                       f"{rows}")
            continue
        if np.any(status == PENDING):
            continue  # not finished: the next run writes it anyway
        want = recorded(b.index)
        if isinstance(want, str):   # a finished block without its record lost it (it is written first)
            report.damaged[b.index] = f"{want}{rows}"
            continue
        for name, recorded_sum in want.items():
            why = mismatch(f"{name} chunk {sets.chunk_word}", sets.chunk_sum(fs, name, b.index, crc=not quick),
                           recorded_sum, crc=not quick)
            if why:
                report.damaged[b.index] = f"{why}{rows}"
                break
    return report


def mismatch(what: str, got: tuple[int, int], want: tuple[int, int], crc: bool = True) -> str | None:
    """How the chunk ``what`` (its CRC-32 and size ``got``) differs from its record ``want``, or None."""
    (crc_now, size), (wcrc, wsize) = got, want
    if size != wsize:
        if wsize == ABSENT:
            return f"{what} {size} bytes where none were written"
        return f"{what} {'missing' if size == ABSENT else f'{size} bytes, expected {wsize}'}"
    if crc and crc_now != wcrc:
        return f"{what}'s CRC-32 {crc_now:08x} != recorded {wcrc:08x}"
    return None


def recorded_sums(fs: "FeatureSet", whole: bool = True) -> Callable[[int], "dict[str, tuple[int, int]] | str"]:
    """On a disk: block index → the (CRC, size) recorded of each checksummed array, or why there is
    none (the set lost its ``blocksums`` array or its list of arrays, an unreadable checksum chunk, or
    nothing recorded for a finished block). ``whole``: the table is read at once (else per block)."""
    names = fs.group.attrs.get("checksummed") or []
    if not names or not fs.has_array(SUMS):
        why = ("its rows are finished but " + (f"the {SUMS} array is missing" if names else
                                                "the set's list of checksummed arrays is missing"))
        return lambda index: why
    sums = fs.group[SUMS]
    try:
        table = np.asarray(sums[:]) if whole else None
    except Exception:   # an unreadable checksum chunk: each block's read alone, so the others are checked
        table = None

    def at(index: int) -> "dict[str, tuple[int, int]] | str":
        try:
            want = table[index] if table is not None else np.asarray(sums[index])
        except Exception as exc:
            return f"checksum chunk unreadable ({type(exc).__name__})"
        if np.all(want == UNRECORDED):
            return "its rows are finished but no checksum is recorded"
        return {name: (int(want[2 * k]), int(want[2 * k + 1])) for k, name in enumerate(names)}
    return at


def repair(fs: "FeatureSet", report: Report) -> int:
    """Mark the damaged blocks of ``report`` pending (on a disk: status and checksums reset; on object
    storage: :func:`.objcommit.repair`); returns how many."""
    return fs.store.sets.repair(fs, report)


def repair_sums(fs: "FeatureSet", report: Report) -> int:
    """:func:`repair` on a disk."""
    blocks = fs.blocks()
    for i in sorted(report.damaged):
        b = blocks[i]
        if fs.has_array(SUMS):
            point("repair:sums")
            fs.group[SUMS][i] = np.full(fs.group[SUMS].shape[1], UNRECORDED, dtype=np.int64)
        point("repair:status")
        fs.status[b.start:b.stop] = np.zeros(len(b), dtype=np.uint8)
    return len(report.damaged)


def refuse_damaged(fs: "FeatureSet") -> None:
    """Raise StoreError if the quick check finds damaged blocks (``train`` calls this before reading)."""

    report = verify(fs, quick=True)
    if not report.ok:
        first = sorted(report.damaged.items())[0]
        raise StoreError(f"feature set {fs.name!r} in {fs.store.path} is damaged: {len(report.damaged)} of "
                         f"{report.blocks} blocks (first: block {first[0]}: {first[1]}). {_repair_it(fs)}")


def _repair_it(fs: "FeatureSet") -> str:
    return (f"Repair it with `vsekit info {fs.store.path} {fs.name} --verify --repair` and then "
            f"`{remake_command(fs.store, fs.name)}`")


def block_committed(fs: "FeatureSet", block: "Block") -> bool:
    """Whether ``block`` is finished (no pending row) and its chunk files match their recorded sizes.

    A dask task asks this before computing and again before writing its block, so a block that a lost
    worker already committed is never computed or written twice (see :mod:`vsekit.extract.distribute`).
    A block with an unreadable status chunk or missing/truncated files counts as not committed.
    On object storage: whether it has its commit record (:mod:`.objcommit`).
    """
    return fs.store.sets.committed(fs, block)


def sums_committed(fs: "FeatureSet", block: "Block") -> bool:
    """:func:`block_committed` on a disk: finished, with its checksums recorded (before the status: a
    finished block without them lost them) and its chunk files of the recorded sizes."""
    status = status_block(fs, block)
    if isinstance(status, str) or np.any(status == PENDING) or np.any(status > 2):
        return False
    want = recorded_sums(fs, whole=False)(block.index)
    return not isinstance(want, str) and all(file_sum(fs, name, block.index, crc=False)[1] == size
                                             for name, (_, size) in want.items())


class BlockCheck:
    """Checks each block a reader reads (``train``, ``evaluate``) against the recorded checksums.

    The checksums, status and generation are taken once when the reader opens the set; then every
    chunk file read is compared (CRC-32 and size) before its rows are used, and the set's generation
    is read again, so a set remade by ``--overwrite`` meanwhile is refused instead of mixed in.
    A finished block without its checksum record is refused as damaged. On object storage the
    record of a block is its commit record (:mod:`.objcommit`) and a chunk is re-read as an object.
    """

    def __init__(self, fs: "FeatureSet", arrays: Sequence[str] = ("data",)):

        self.fs = fs
        self.blocks = fs.blocks()
        names = list(fs.group.attrs.get("checksummed") or [])
        self.columns = {a: names.index(a) for a in arrays if a in names}
        self.recorded = fs.store.sets.recorded(fs)
        self.records = bool(names)
        self.status = fs.status_values()
        self.generation = fs.generation

    def expected(self, index: int, array: str) -> tuple[int, int] | None:
        """(CRC, size) recorded for ``array``'s chunk ``index``; None when there is nothing to check."""
        if self.records and array not in self.columns:
            return None   # an array the set does not have (no per-row count)
        block = self.blocks[index]
        unfinished = bool(np.any(self.status[block.start:block.stop] == PENDING))
        want = self.recorded(index)
        if isinstance(want, str):
            return None if unfinished else self.refuse(index, want)
        crc, size = want.get(array, (0, ABSENT))
        return int(crc), int(size)

    def check_sum(self, index: int, array: str, crc: int, size: int) -> None:
        """Refuse block ``index`` unless ``crc``/``size`` (of the bytes just read) match the record."""
        want = self.expected(index, array)
        why = None if want is None else mismatch(f"{array} chunk file", (crc, size), want)
        if why:
            self.refuse(index, why)

    def check_file(self, index: int, array: str) -> None:
        """Re-read chunk file ``index`` of ``array`` and check it (readers that decode through zarr)."""
        if self.expected(index, array) is not None:
            self.check_sum(index, array, *self.fs.store.sets.chunk_sum(self.fs, array, index, crc=True))

    def check_generation(self) -> None:
        """Refuse to go on if the set was replaced (``--overwrite``) since the reader opened it."""

        now = self.fs.generation
        if now != self.generation:
            raise StoreError(
                f"feature set {self.fs.name!r} in {self.fs.store.path} was replaced (another run made it "
                f"again with --overwrite) while this command was reading it; nothing read after the "
                f"change was used. Rerun the command")

    def refuse(self, index: int, why: str):

        self.check_generation()   # a set made again meanwhile differs from the record, but is not damaged
        block = self.blocks[index]
        raise StoreError(f"feature set {self.fs.name!r} in {self.fs.store.path}: block {index} (rows "
                         f"{block.start}-{block.stop - 1}) is damaged ({why}); its rows were not used. "
                         f"{_repair_it(self.fs)}")


def crc_of(view, value: int = 0) -> int:
    """CRC-32 of a buffer (``zlib.crc32``, which releases the GIL for large buffers)."""
    return zlib.crc32(view, value)
