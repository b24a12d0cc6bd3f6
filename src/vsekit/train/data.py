"""Training and evaluation data over a vsekit store: feature rows, caption tokens, splits.

Features are read chunk by chunk, never whole: an epoch shuffles the feature set's row chunks, reads
them in windows sized from a memory budget (``shuffle_memory``; the whole split when it fits, then an
epoch is one global permutation), the next window read ahead, and shuffles the pairs inside a window
(docs/train.md, "What training does"). Tokens are small and read once. Per epoch either one random
caption per image (the FNE paper) or every caption (VSE++).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..fne.pack import unpack
from ..storage.chunks import ChunkReader
from .distributed import part_slice
from ..storage.splits import refuse_stale
from ..storage.base import no_tokens
from ..storage.store import DONE, FAILED, FeatureSet, FeatureStore, StoreError

CAPTION_MODES = ("one", "all")
PAD_ID = 0
SHUFFLE_MEMORY_GB = 4.0   # default budget of the training window buffers (decoded float32 rows)


# tokens -------------------------------------------------------------------------------------------
@dataclass
class Tokens:
    """Every caption's token ids, concatenated (``ids``), and where each caption starts (``offsets``)."""

    ids: np.ndarray
    offsets: np.ndarray
    vocabulary: list[str]

    @classmethod
    def from_store(cls, store: FeatureStore) -> "Tokens":
        if not store.has_tokens:
            raise StoreError(no_tokens(store.path))
        g = store.root["tokens"]
        ids = np.asarray(g["ids"][:], dtype=np.int64)
        offsets = np.asarray(g["offsets"][:], dtype=np.int64)
        vocab = list(g.attrs.get("vocabulary") or [])
        if len(offsets) != store.n_captions + 1:
            raise StoreError(f"{store.path}: tokens/offsets has {len(offsets)} entries but the store has "
                             f"{store.n_captions} captions (expected {store.n_captions + 1}); rerun tokenize")
        if not vocab:
            vocab = [str(i) for i in range(int(ids.max(initial=3)) + 1)]
        return cls(ids, offsets, vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def batch(self, captions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded (B, L) token ids (pad 0) and true lengths (at least 1) of ``captions``."""
        captions = np.asarray(captions, dtype=np.int64)
        starts = self.offsets[captions]
        lengths = self.offsets[captions + 1] - starts
        width = max(1, int(lengths.max(initial=1)))
        pos = np.arange(width)[None, :]
        mask = pos < lengths[:, None]
        idx = np.where(mask, starts[:, None] + pos, 0)
        padded = np.where(mask, self.ids[idx] if len(self.ids) else 0, PAD_ID)
        return torch.from_numpy(padded.astype(np.int64)), torch.from_numpy(np.maximum(lengths, 1))


# features -----------------------------------------------------------------------------------------
class FeatureSource:
    """Rows of a feature set as float32 arrays, whatever the stored layout (float, FNE int8, packed).

    ``row_shape`` is the decoded shape of one row: ``(D,)`` global, ``(G, G, C)`` grid, ``(K, C)``
    regions (with a per-row ``count``). The same interface wraps an in-memory array
    (``FeatureSource.from_array``), which the loader benchmark compares against.
    """

    def __init__(self, fs: FeatureSet | None = None, *, array: np.ndarray | None = None,
                 counts: np.ndarray | None = None, chunk_rows: int | None = None):
        self.fs = fs
        if fs is not None:
            attrs = fs.attrs
            self.kind = attrs.get("kind", "global")
            self.packed = bool(attrs.get("packed", False))
            self.n_features = int(attrs.get("n_features", fs.shape[-1]))
            self._data = fs.data
            self._count = fs.array("count") if fs.has_array("count") else None
            self.chunk_rows = fs.chunk_rows
            self.n_rows = fs.n_rows
            stored = fs.shape[1:]
            self.row_shape = (*stored[:-1], self.n_features) if self.packed else tuple(stored)
            self.name = fs.name
            self.reader: ChunkReader | None = ChunkReader(fs)   # checked raw reads of the chunk files
        else:
            assert array is not None
            self.kind = "global" if array.ndim == 2 else ("grid" if array.ndim == 4 else "regions")
            self.packed, self.n_features = False, int(array.shape[-1])
            self._data, self._count = array, counts
            self.chunk_rows = int(chunk_rows or 256)
            self.n_rows = int(array.shape[0])
            self.row_shape = tuple(array.shape[1:])
            self.name = "<array>"
            self.reader = None

    @classmethod
    def from_array(cls, array: np.ndarray, counts: np.ndarray | None = None, chunk_rows: int = 256) -> "FeatureSource":
        return cls(array=array, counts=counts, chunk_rows=chunk_rows)

    @property
    def image_input(self) -> str:
        return {"fne": "global"}.get(self.kind, self.kind)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Decoded rows ``[start, stop)`` (float32) and their region counts (or None).

        The chunk files of every block read are checked against their recorded CRC-32 first.
        """
        if self.reader is not None and self.reader.remote:   # one checked GET per block and array
            raw, counts = self.reader.read_rows(start, stop)
        else:
            if self.reader is not None:
                self.reader.verify(start, stop)
            raw, counts = np.asarray(self._data[start:stop]), None if self._count is None else self._count[start:stop]
            if self.reader is not None:
                self.reader.check_generation()
        if self.packed:
            raw = unpack(raw, self.n_features)
        return raw.astype(np.float32, copy=False), None if counts is None else np.asarray(counts, dtype=np.int64)

    def read_into(self, start: int, stop: int, out: np.ndarray, counts_out: np.ndarray | None = None) -> None:
        """Rows ``[start, stop)`` decoded into ``out`` (float32, ``stop - start`` rows), counts into ``counts_out``.

        A raw float32 chunk file is read straight into ``out``; anything else goes through :meth:`read`.
        """
        raw_file = (self.reader.raw_file(start, stop) if self.reader is not None and not self.packed
                    and out.flags.c_contiguous else None)
        if raw_file is not None:
            self.reader.read_raw(raw_file, start, out)
            counts = None if self._count is None else self._count[start:stop]
            self.reader.check_generation()
        else:
            data, counts = self.read(start, stop)
            out[...] = data
        if counts_out is not None and counts is not None:
            counts_out[:] = counts

    @property
    def requests(self) -> int:
        """How many of this source's reads may run at once: the store's ``read_requests`` on object
        storage (each holds one chunk's bytes), else 1 (the callers' own thread count applies)."""
        return self.reader.requests if self.reader is not None else 1

    def chunks(self) -> list[tuple[int, int]]:
        step = self.chunk_rows
        return [(s, min(s + step, self.n_rows)) for s in range(0, self.n_rows, step)]


def open_features(store: FeatureStore, name: str, rows: np.ndarray) -> FeatureSource:
    """The feature set ``name``, refusing it if any of ``rows`` is still pending."""
    fs = store.features(name)
    if fs.n_rows != store.n_images:
        raise StoreError(f"feature set {name!r} has {fs.n_rows} rows but the store has {store.n_images} images")
    from ..storage.integrity import refuse_damaged

    refuse_damaged(fs)   # a deleted or truncated chunk would otherwise be read as zeros
    refuse_stale(fs)     # statistics of a split that `vsekit split` has changed since
    status = np.asarray(fs.status[:])
    pending = rows[status[rows] != DONE]
    pending = pending[status[pending] != FAILED]
    if len(pending):
        raise StoreError(f"feature set {name!r}: {len(pending)} rows needed here are pending "
                         f"(first row {int(pending[0])}); finish the extraction first")
    return FeatureSource(fs)


def usable_rows(store: FeatureStore, fs: FeatureSource, split: str) -> np.ndarray:
    """Image rows of ``split`` whose features are done (failed rows are left out)."""
    rows, status = _split_status(store, fs, split)
    rows = rows[status == DONE]
    if not len(rows):
        raise StoreError(f"{store.path}: split {split!r} has no usable images in {fs.name!r} (it is empty, or "
                         f"every image in it failed: `vsekit info {store.path} {fs.name}` lists them); choose "
                         f"another split, or re-split keeping the features: `vsekit split --store {store.path} ...`")
    return rows


#: a validation split with fewer usable images than this gets a warning that its figures are noise
SMALL_VAL = 100


def _split_status(store: FeatureStore, fs: FeatureSource, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The image rows of ``split`` and their features' status (all done in an in-memory source)."""
    rows = store.split_rows(split)
    return rows, np.full(len(rows), DONE) if fs.fs is None else np.asarray(fs.fs.status[:])[rows]


def _first_failure(store: FeatureStore, fs: FeatureSource, failed: np.ndarray) -> str:
    if not len(failed) or fs.fs is None:
        return ""
    r = int(failed[0])
    why = fs.fs.errors().get(r, "failed")
    return f"; failed: row {r} (id {store.image_ids()[r]}): {why}"


def failed_note(store: FeatureStore, fs: FeatureSource, split: str) -> str | None:
    """"2 failed rows of split 'test' left out ..." when a command skips failed rows, else None."""
    from ..words import plural

    rows, status = _split_status(store, fs, split)
    failed = rows[status == FAILED]
    if not len(failed):
        return None
    return (f"{plural(len(failed), 'failed row')} of split {split!r} in {fs.name!r} left out, with their "
            f"captions: {len(rows) - len(failed)} of {plural(len(rows), 'image')} used "
            f"(`vsekit info {store.path} {fs.name}` lists them)")


def training_rows(store: FeatureStore, fs: FeatureSource, train_split: str, val_split: str,
                  log=None) -> tuple[np.ndarray, "EvalSet"]:
    """The usable training rows and the validation set, said and checked before training starts.

    Failed rows are skipped and counted; a validation split without a usable image is refused with
    the ways to choose one (``--val-split``, ``vsekit split``, a retry); one under :data:`SMALL_VAL`
    images gets a warning that the validation figures (and the best epoch they pick) are noise.
    """
    from ..words import plural

    log = log or (lambda msg: None)
    for split in dict.fromkeys((train_split, val_split)):
        note = failed_note(store, fs, split)
        if note:
            log(f"note: {note}")
    rows, status = _split_status(store, fs, val_split)
    failed, usable = rows[status == FAILED], int(np.sum(status == DONE))
    if usable == 0:
        others = [s for s in ("val", "test", "restval")
                  if s != val_split and (_split_status(store, fs, s)[1] == DONE).any()]
        choose = f"choose other rows with --val-split {others[0]}, or " if others else ""
        raise StoreError(
            f"{store.path}: the validation split {val_split!r} has no usable images in {fs.name!r} "
            f"({plural(len(rows), 'image')}{_first_failure(store, fs, failed)}). To validate, {choose}"
            f"re-split the store keeping its features (`vsekit split --store {store.path} --val N --test N`), "
            f"or retry the failed rows (`vsekit info {store.path} {fs.name}` shows how)")
    if val_split == train_split:
        log(f"warning: --val-split {val_split} is the training split: val rsum measures fit, not retrieval")
    elif usable < SMALL_VAL:
        log(f"warning: the validation split {val_split!r} has {plural(usable, 'usable image')} (under "
            f"{SMALL_VAL}): the val rsum of each epoch, and the best epoch it picks, are noise; validate on more "
            f"with --val-split or `vsekit split --store {store.path} --val N`")
    if store.has_tokens and store.root["tokens"].attrs.get("stale"):
        log(f"note: {store.root['tokens'].attrs['stale']}")
    return usable_rows(store, fs, train_split), EvalSet.from_store(store, val_split, fs)


# the training stream ------------------------------------------------------------------------------
def window_chunks_for(chunk_rows: list[int], row_bytes: int, budget_bytes: int, head_rows: int = 0) -> int:
    """How many chunks one shuffle window holds under a memory budget of ``budget_bytes``.

    ``chunk_rows``: the rows of each chunk the epoch reads; ``row_bytes``: one decoded row;
    ``head_rows``: rows kept in front of each window for the pairs carried over. If one buffer of
    all the chunks fits the budget, every chunk is in one window (a global shuffle); else two
    buffers (one read ahead while the other is consumed) share it, each holding as many of the
    largest chunks as fit, at least one.
    """
    n = len(chunk_rows)
    if n == 0:
        return 1
    if (sum(chunk_rows) + head_rows) * row_bytes <= budget_bytes:
        return n
    per_window = budget_bytes // 2 // max(1, row_bytes) - head_rows
    return int(min(n, max(1, per_window // max(1, max(chunk_rows)))))


@dataclass
class Batch:
    feats: torch.Tensor
    counts: torch.Tensor | None
    tokens: torch.Tensor
    lengths: torch.Tensor
    images: torch.Tensor  # image row of every pair (pairs of one image are not negatives)
    #: data-parallel (:meth:`PairStream.epoch_part`): which rows of the global batch ``feats``,
    #: ``counts``, ``tokens`` and ``lengths`` hold (``images`` is always the whole batch's); None: all
    part: slice | None = None


class PairStream:
    """Chunk-aware shuffled batches of (image features, caption tokens) pairs for one epoch.

    ``captions="one"`` draws one random caption per image, ``"all"`` uses every caption. The epoch's
    randomness is ``numpy.random.default_rng([seed, epoch])``, so a resumed run sees the same
    batches as an uninterrupted one. ``window_chunks`` fixes the window; None (the default) sizes
    it from ``shuffle_memory`` (bytes) by :func:`window_chunks_for`.
    """

    def __init__(self, source: FeatureSource, tokens: Tokens, rows: np.ndarray, caption_images: np.ndarray,
                 *, batch_size: int = 128, captions: str = "one", window_chunks: int | None = None, seed: int = 0,
                 shuffle_memory: float = SHUFFLE_MEMORY_GB * 2**30, read_threads: int = 2):
        if captions not in CAPTION_MODES:
            raise ValueError(f"unknown captions mode {captions!r}; valid choices: {', '.join(CAPTION_MODES)}")
        if batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
        self.source, self.tokens = source, tokens
        self.batch_size, self.captions = int(batch_size), captions
        if shuffle_memory is None or not shuffle_memory > 0:
            raise ValueError(f"--shuffle-memory must be positive, got {shuffle_memory}")
        self.seed, self.shuffle_memory = int(seed), int(shuffle_memory)
        self.read_threads = max(1, int(read_threads))
        # window chunks read at once: on object storage the store's read_requests (one GET each)
        remote = source.reader is not None and source.reader.remote
        self.read_workers = source.requests if remote else self.read_threads
        # captions of each usable image, CSR by image row
        in_split = np.zeros(source.n_rows, dtype=bool)
        in_split[rows] = True
        caps = np.flatnonzero(in_split[caption_images])
        order = np.argsort(caption_images[caps], kind="stable")
        self._caps = caps[order]
        owners = caption_images[self._caps]
        self._cap_start = np.searchsorted(owners, np.arange(source.n_rows), side="left")
        self._cap_count = np.searchsorted(owners, np.arange(source.n_rows), side="right") - self._cap_start
        self.rows = rows[self._cap_count[rows] > 0]
        if not len(self.rows):
            raise StoreError("no training image has a caption")
        in_rows = np.zeros(source.n_rows, dtype=bool)
        in_rows[self.rows] = True
        self._chunks = [c for c in source.chunks() if in_rows[c[0]:c[1]].any()]
        if window_chunks is None:
            row_bytes = 4 * int(np.prod(source.row_shape)) + (8 if source._count is not None else 0)
            window_chunks = window_chunks_for([b - a for a, b in self._chunks], row_bytes, self.shuffle_memory,
                                              head_rows=self.batch_size)
        self.window_chunks = max(1, int(window_chunks))

    @property
    def global_shuffle(self) -> bool:
        """True when the whole split is one window: each epoch is one permutation of all its pairs."""
        return self.window_chunks >= len(self._chunks)

    def __len__(self) -> int:
        n = len(self.rows) if self.captions == "one" else int(self._cap_count[self.rows].sum())
        return -(-n // self.batch_size)

    def _pairs(self, rows: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        if self.captions == "one":
            pick = self._cap_start[rows] + (rng.random(len(rows)) * self._cap_count[rows]).astype(np.int64)
            return rows, self._caps[pick]
        counts = self._cap_count[rows]
        img = np.repeat(rows, counts)
        first = np.repeat(self._cap_start[rows] - np.cumsum(counts) + counts, counts)
        return img, self._caps[first + np.arange(len(img))]

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches; ``skip``: the first ``skip`` batches are drawn (the same random
        numbers) but not built nor yielded (a run resumed mid-epoch continues where it stopped).
        The windows and their pair tables come from :meth:`_plans`, which :meth:`epoch_part` uses
        too: one process and every rank of a data-parallel run cut the same stream."""
        plans = self._plans(epoch)
        windows = [plan["window"] for plan in plans]
        rows = self.batch_size + max((sum(b - a for a, b in w) for w in windows), default=0)
        carry, cut = {}, 0
        buffers = self._prefetch(windows, self._buffers(rows, max(1, min(2, len(windows)))))
        for plan, (feats, counts) in zip(plans, buffers):
            cut, carry = yield from self._part_batches(plan, feats, counts, None, carry, 0, 1, skip, cut)

    def epoch_part(self, epoch: int, rank: int, world: int, skip: int = 0) -> Iterator[Batch]:
        """This rank's rows of each of :meth:`epoch`'s batches (``Batch.part`` says which): the same
        stream (windows sized from the whole ``shuffle_memory``, the same random numbers), each window's
        chunks read but only this rank's slices and the carried pairs kept, about ``1 / world`` of a
        window (docs/train.md, "Data per rank"). Tokens are cut at the global batch's width."""
        from concurrent.futures import ThreadPoolExecutor

        plans = self._plans(epoch)
        carry = {}                       # window position (< head) -> (features, count) of carried pairs
        cut = 0
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(self._read_part, plans[0], rank, world, skip) if plans else None
            for wi, plan in enumerate(plans):
                rows, index = future.result()
                future = (pool.submit(self._read_part, plans[wi + 1], rank, world, skip)
                          if wi + 1 < len(plans) else None)
                feats_buf, counts_buf = rows
                cut, carry = yield from self._part_batches(plan, feats_buf, counts_buf, index, carry, rank, world,
                                                           skip, cut)

    def epoch_shared(self, epoch: int, rank: int, world: int, node: Any, skip: int = 0) -> Iterator[Batch]:
        """:meth:`epoch_part`'s batches, with the window read once per node into shared memory: the
        node's leader (``node``, :class:`vsekit.train.distributed.NodeShare`) reads each window, one
        ahead, into one of two buffers every rank of the node maps, and each rank copies out its rows;
        without room for the buffers on any node every rank falls back to :meth:`epoch_part`, agreed
        by all (docs/train.md, "Data per rank")."""
        plans = self._plans(epoch)
        rows = self.batch_size + max((sum(b - a for a, b in p["window"]) for p in plans), default=0)
        shape = tuple(self.source.row_shape)
        with_counts = self.source._count is not None
        nbytes = 2 * rows * (4 * int(np.prod(shape)) + (8 if with_counts else 0))
        bufs = node.open_buffers(nbytes, [((rows, *shape), np.float32)] * 2
                                 + ([((rows,), np.int64)] * 2 if with_counts else []))
        if bufs is None:
            yield from self.epoch_part(epoch, rank, world, skip=skip)
            return
        pairs = list(zip(bufs[:2], bufs[2:] if with_counts else [None, None]))
        carry, cut = {}, 0
        windows = [plan["window"] for plan in plans]
        buffers = self._prefetch(windows, pairs, read=node.leader,
                                 sync=lambda wi: node.sync(f"window {wi + 1} of epoch {epoch}"))
        for plan, (feats, counts) in zip(plans, buffers):
            cut, carry = yield from self._part_batches(plan, feats, counts, None, carry, rank, world, skip, cut)

    def _part_batches(self, plan: dict, feats: np.ndarray, counts: np.ndarray | None, index: np.ndarray | None,
                      carry: dict, rank: int, world: int, skip: int, cut: int):
        """This rank's part of each batch of a window after the epoch's first ``skip``; returns the
        epoch's batch count so far and the pairs carried to the next window (window position ->
        (features, count)). A window position ``p`` below the head is a pair carried from the last
        window (``carry``); the others are the window's rows: ``feats[p]`` where the whole window is
        held, ``feats[index[p - head]]`` where only some of its rows were read (``index``)."""
        head = self.batch_size

        def take(positions):
            if positions.min(initial=head) >= head:   # no carried pair: one gather
                at = positions if index is None else index[positions - head]
                return feats[at], None if counts is None else counts[at]
            out_f = np.empty((len(positions), *self.source.row_shape), dtype=np.float32)
            out_c = None if counts is None else np.empty(len(positions), dtype=np.int64)
            new = positions >= head
            at = positions[new] if index is None else index[positions[new] - head]
            out_f[new] = feats[at]
            if out_c is not None:
                out_c[new] = counts[at]
            for i in np.flatnonzero(~new):
                out_f[i], c = carry[int(positions[i])]
                if out_c is not None:
                    out_c[i] = c
            return out_f, out_c

        img, cap, pos = plan["img"], plan["cap"], plan["pos"]
        for a, b in plan["cuts"]:
            cut += 1
            if cut <= skip:
                continue
            part = part_slice(b - a, rank, world) if world > 1 else None   # one process: the whole batch
            mine = slice(None) if part is None else part
            tokens, lengths = self.tokens.batch(cap[a:b])
            f, c = take(pos[a:b][mine])
            yield Batch(torch.from_numpy(f), None if c is None else torch.from_numpy(c),
                        tokens[mine], lengths[mine], torch.from_numpy(img[a:b]), part)
        rest = pos[plan["n_full"]:]
        f, c = take(rest)
        first = self.batch_size - len(rest)
        return cut, {first + i: (f[i], None if c is None else c[i]) for i in range(len(rest))}

    def _plans(self, epoch: int) -> list[dict]:
        """Every window of the epoch as :meth:`epoch` forms it (chunks, pair table after the shuffle,
        where its batches are cut), from the same random numbers, before any data is read."""
        rng = np.random.default_rng([self.seed, int(epoch)])
        in_rows = np.zeros(self.source.n_rows, dtype=bool)
        in_rows[self.rows] = True
        chunks = self._chunks
        order = rng.permutation(len(chunks))
        windows = [[chunks[ci] for ci in order[w:w + self.window_chunks]]
                   for w in range(0, len(order), self.window_chunks)]
        head = self.batch_size
        left_img = left_cap = np.zeros(0, dtype=np.int64)
        plans, batches = [], 0
        for wi, window in enumerate(windows):
            imgs, off = [], head
            for start, stop in window:
                local = np.flatnonzero(in_rows[start:stop])
                img, cap = self._pairs(start + local, rng)
                imgs.append(np.stack([img, cap, off + img - start]))
                off += stop - start
            n_left = len(left_img)
            table = np.concatenate(imgs, axis=1)
            img = np.concatenate([left_img, table[0]])
            cap = np.concatenate([left_cap, table[1]])
            pos = np.concatenate([np.arange(head - n_left, head), table[2]])
            perm = rng.permutation(len(img))
            img, cap, pos = img[perm], cap[perm], pos[perm]
            last = wi == len(windows) - 1
            n_full = len(img) if last else (len(img) // self.batch_size) * self.batch_size
            cuts = [(b, min(b + self.batch_size, n_full)) for b in range(0, n_full, self.batch_size)]
            plans.append({"window": window, "img": img, "cap": cap, "pos": pos, "n_full": n_full, "cuts": cuts,
                          "first_batch": batches})
            batches += len(cuts)
            left_img, left_cap = img[n_full:], cap[n_full:]
        return plans

    def _read_part(self, plan: dict, rank: int, world: int, skip: int):
        """The window rows this rank needs (its slices of the batches it will train, and the pairs
        carried on), read chunk by chunk into a compact buffer; returns the buffers and the map from
        window position (after the head) to buffer row."""
        head = self.batch_size
        pos = plan["pos"]
        need = [pos[plan["n_full"]:]]
        for i, (a, b) in enumerate(plan["cuts"]):
            if plan["first_batch"] + i >= skip:
                need.append(pos[a:b][part_slice(b - a, rank, world)])
        wanted = np.unique(np.concatenate(need)) if need else np.zeros(0, dtype=np.int64)
        wanted = wanted[wanted >= head]
        total = sum(stop - start for start, stop in plan["window"])
        index = np.full(total, -1, dtype=np.int64)
        index[wanted - head] = np.arange(len(wanted))
        feats = np.empty((len(wanted), *self.source.row_shape), dtype=np.float32)
        counts = np.zeros(len(wanted), dtype=np.int64) if self.source._count is not None else None
        spans, sels, off = [], [], head
        for start, stop in plan["window"]:
            sel = wanted[(wanted >= off) & (wanted < off + stop - start)]
            if len(sel):
                spans.append((start, stop))
                sels.append((sel, off))
            off += stop - start
        for (sel, off), (_, (data, cnt)) in zip(sels, read_spans(self.source, spans, self.source.requests)):
            feats[index[sel - head]] = data[sel - off]
            if counts is not None and cnt is not None:
                counts[index[sel - head]] = cnt[sel - off]
            del data
        self.part_rows_peak = max(getattr(self, "part_rows_peak", 0), len(wanted))
        return (feats, counts), index

    def _buffers(self, rows: int, count: int = 2) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """``count`` reusable window buffers (two: one being read, one being consumed; one when the
        whole split is one window), grown on demand.

        Reusing them across windows and epochs spares the allocation and first-touch page faults
        of a fresh window-sized array per window, which cost as much as the copy itself.
        """
        bufs = getattr(self, "_bufs", None)
        if bufs is None or len(bufs[0][0]) < rows or len(bufs) != count:
            self._bufs = bufs = None   # let the old buffers go before the new ones are allocated
            shape = tuple(self.source.row_shape)
            with_counts = self.source._count is not None
            bufs = [(np.empty((rows, *shape), dtype=np.float32),
                     np.zeros(rows, dtype=np.int64) if with_counts else None) for _ in range(count)]
            self._bufs = bufs
        return bufs

    def _prefetch(self, windows: list[list[tuple[int, int]]], bufs: list, read: bool = True,
                  sync: Callable[[int], None] | None = None) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Each window's chunks decoded into the window buffer ``bufs[w % len(bufs)]`` (a (features,
        counts) pair; after a head of ``batch_size`` free rows), by a background pool one window
        ahead of the consumer. ``read`` False: another rank fills the buffers (the node's leader);
        ``sync(w)``: the ranks meet once window w is read (and all are done with the other buffer)."""
        from concurrent.futures import ThreadPoolExecutor

        def submit(pool, w):
            if not read or w >= len(windows):
                return []
            feats, counts = bufs[w % len(bufs)]
            jobs, off = [], self.batch_size
            for start, stop in windows[w]:
                n = stop - start
                jobs.append(pool.submit(self.source.read_into, start, stop, feats[off:off + n],
                                        None if counts is None else counts[off:off + n]))
                off += n
            return jobs

        with ThreadPoolExecutor(max_workers=self.read_workers) as pool:
            pending = submit(pool, 0)
            for w in range(len(windows)):
                for job in pending:
                    job.result()
                if sync is not None:
                    sync(w)
                # the other buffer held window w - 1, which the consumer has finished with
                pending = submit(pool, w + 1)
                yield bufs[w % len(bufs)]


# evaluation data ----------------------------------------------------------------------------------
def image_batches(source: FeatureSource, rows: np.ndarray, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Features of ``rows`` (sorted) in order, read one stored chunk at a time."""
    rows = np.asarray(rows, dtype=np.int64)
    buf, cbuf = [], []
    if np.any(rows[1:] <= rows[:-1]):   # the batches follow the chunks: an order of its own would be lost
        raise ValueError("image_batches: rows must be sorted and distinct")
    cuts = [(a, b, *np.searchsorted(rows, [a, b])) for a, b in source.chunks()]
    spans = [(a, b) for a, b, lo, hi in cuts if hi > lo]
    sels = [rows[lo:hi] for a, b, lo, hi in cuts if hi > lo]
    for sel, ((start, stop), (data, counts)) in zip(sels, read_spans(source, spans, source.requests)):
        buf.append(data[sel - start])
        cbuf.append(None if counts is None else counts[sel - start])
        while sum(len(b) for b in buf) >= batch_size:
            yield from _emit(buf, cbuf, batch_size)
    if buf:
        yield from _emit(buf, cbuf, None)


def read_spans(source: FeatureSource, spans: list[tuple[int, int]], requests: int
               ) -> Iterator[tuple[tuple[int, int], tuple[np.ndarray, np.ndarray | None]]]:
    """``source.read`` of each span, yielded in order, with up to ``requests`` reads running at once
    (object storage: a GET each) and at most ``requests`` read spans held ahead of the consumer."""
    if requests <= 1 or len(spans) <= 1:
        for span in spans:
            yield span, source.read(*span)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    from itertools import islice

    with ThreadPoolExecutor(max_workers=requests) as pool:
        todo = iter(spans)
        pending = deque((span, pool.submit(source.read, *span)) for span in islice(todo, requests))
        try:
            while pending:
                span, future = pending.popleft()
                got = future.result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(source.read, *nxt)))
                yield span, got
                del got
        finally:
            for _, future in pending:
                future.cancel()


def _emit(buf: list, cbuf: list, size: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    data = np.concatenate(buf)
    counts = None if cbuf[0] is None else np.concatenate(cbuf)
    size = len(data) if size is None else size
    buf.clear()
    cbuf.clear()
    yield (torch.from_numpy(np.ascontiguousarray(data[:size])),
           None if counts is None else torch.from_numpy(counts[:size]))
    if len(data) > size:
        buf.append(data[size:])
        cbuf.append(None if counts is None else counts[size:])


@dataclass
class EvalSet:
    """The images of a split and their captions, with each caption's image as an index into ``rows``."""

    rows: np.ndarray
    captions: np.ndarray
    caption_image: np.ndarray

    @classmethod
    def from_store(cls, store: FeatureStore, split: str, source: FeatureSource | None = None) -> "EvalSet":
        rows = usable_rows(store, source, split) if source is not None else store.split_rows(split)
        cap_img = store.caption_images()
        index = np.full(store.n_images, -1, dtype=np.int64)
        index[rows] = np.arange(len(rows))
        caps = np.flatnonzero(index[cap_img] >= 0)
        if not len(caps):
            raise StoreError(f"{store.path}: split {split!r} has no captions")
        return cls(rows, caps, index[cap_img[caps]])


def describe_source(source: FeatureSource) -> dict[str, Any]:
    return {"name": source.name, "kind": source.kind, "row_shape": list(source.row_shape), "packed": source.packed}
