"""The reader: a Dataset over image rows whose items are uint8 crops, and a batch iterator that
survives a crashing decoder process.

Decoding runs in DataLoader worker processes (``workers`` > 0) or in-process (``workers`` = 0, as
inside dask tasks, whose daemonic worker processes cannot have children). A bad image becomes an
item with an error message instead of an exception, so the run goes on.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..storage.faults import point
from .images import ImageError, decode_crops, load_image, resize
from .plan import Plan
from .regions import check_boxes


@dataclass
class Item:
    row: int
    crops: np.ndarray | None        # uint8 (n_crops, H, W, 3); regions: (1, 3, H, W)
    error: str | None = None
    boxes: np.ndarray | None = None  # regions: boxes in input pixels (K, 4)
    scale: tuple[float, float] = (1.0, 1.0)  # input pixels per original pixel (x, y)
    decoder: str = ""                # the process:thread that decoded it (how parallel decoding was)
    encoded: Any = None              # --decoder nvjpeg: the JPEG, decoded by the driving process (gpu_decode)
    reads: Any = None                # a decoding process's image GETs since its last batch (remote.STATS)


class RowDataset:
    """Items for ``rows`` (store rows) from ``paths``; regions also get their boxes."""

    def __init__(self, plan: Plan, rows: Sequence[int], paths: Sequence[str | Path],
                 boxes: dict[int, np.ndarray | str] | None = None, root: str | Path | None = None,
                 expected: dict[str, list] | None = None):
        self.plan = plan
        self.rows = list(rows)
        self.paths = [str(p) for p in paths]
        self.boxes = boxes or {}
        self.root = Path(root).resolve() if root else None   # files must lie under it (None: no check)
        self.expected = expected or {}   # images on object storage: each shard's [size, ETag] at ingest
        from ..storage.sources import remote

        # the options they are read with, in memory (None: none is remote; else a fork server starts the workers)
        self.options = remote.options() if any(remote.is_url(p) for p in self.paths) else None
        self.batches: list[list[int]] | None = None   # the loader's batches, in order (iter_batches sets them)
        self._ahead: tuple[list[int], Any] | None = None   # the next batch's fetch, running while this one decodes
        self._at: dict[tuple, int] | None = None   # a batch's position in ``batches`` (built where they are used)

    def __len__(self) -> int:
        return len(self.rows)

    def fetch(self, indices: Sequence[int]) -> dict:
        """The bytes of the items' images on object storage, fetched together (adjacent members of a
        shard in one ranged GET: :func:`vsekit.storage.sources.remote.fetch`); {} where none is."""
        from ..storage.sources import remote

        urls = [self.paths[i] for i in indices if remote.is_url(self.paths[i])]
        return remote.fetch(urls, self.expected, self.options) if urls else {}

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        """A batch's items (a DataLoader asks so): their remote images fetched at once first; in a
        decoding process, its GETs so far ride on the first item to the run's summary (:func:`iter_batches`)."""
        from torch.utils.data import get_worker_info

        from ..storage.sources import remote

        worker = get_worker_info()
        got = self._fetched(indices, worker)
        items = [self.item(i, got) for i in indices]
        if items and remote.STATS and worker is not None:
            # a new counter, not a copy and a clear: the next batch's fetch may be counting meanwhile
            items[0].reads, remote.STATS = remote.STATS, type(remote.STATS)()
        return items

    def _fetched(self, indices: Sequence[int], worker: Any) -> dict:
        """:meth:`fetch` of ``indices``; in a decoding process, with the images on object storage, the
        fetch of its next batch starts before this one is decoded, so that the requests' latency
        overlaps the decoding (the DataLoader hands each of its W processes every W-th batch; a
        batch not in that order, as in a retry one image at a time, is fetched when asked)."""
        ahead, self._ahead = self._ahead, None
        got = ahead[1].result() if ahead is not None and ahead[0] == list(indices) else self.fetch(indices)
        if worker is not None and self.batches is not None and self.options is not None:
            if self._at is None:
                self._at = {tuple(b): k for k, b in enumerate(self.batches)}
            k = self._at.get(tuple(indices))
            if k is not None and k + worker.num_workers < len(self.batches):
                nxt = self.batches[k + worker.num_workers]
                self._ahead = (nxt, _fetcher().submit(self.fetch, nxt))
        return got

    def __getitem__(self, i: int) -> Item:
        return self.item(i, self.fetch([i]))

    def item(self, i: int, fetched: dict | None = None) -> Item:
        """Item ``i``; ``fetched``: images' bytes (or the error fetching them) by path."""
        row = self.rows[i]
        data = (fetched or {}).get(self.paths[i])
        try:
            if isinstance(data, Exception):
                raise data
            item = self._load(row, self.paths[i], data)
        except (ImageError, ValueError) as exc:
            item = Item(row, None, str(exc))
        except Exception as exc:  # any other decoder failure must not end the run
            item = Item(row, None, f"cannot read {self.paths[i]}: {type(exc).__name__}: {exc}")
        item.decoder = f"{os.getpid()}:{threading.current_thread().name}"
        return item

    def _load(self, row: int, path: str, data: bytes | None = None) -> Item:
        p, fetched = self.plan, () if data is None else (data,)
        self._check_inside_root(path)
        point(f"decode:{os.path.basename(path)}")   # tests: a file whose decoding kills the process
        if p.kind != "regions":
            if p.decoder == "nvjpeg":   # a JPEG: its bytes, for the driving process to decode on the GPU
                from .gpu_decode import encoded

                enc = encoded(path, p, data)
                if enc is not None:
                    return Item(row, None, encoded=enc)
            return Item(row, decode(path, p, *fetched))   # NHWC: no transpose here, the model reads channels-last
        img = decode(path, p, *fetched)
        if p.detector == "butd-r101":  # the detector scales the original image itself (butd.preprocess)
            return Item(row, np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)[None].copy())
        w, h = img.size
        small = resize(img, p.crop_size, "square", p.interpolation, max_resized=p.setting("max_resized_pixels"))
        crops = np.asarray(small, dtype=np.uint8).transpose(2, 0, 1)[None].copy()
        sx, sy = p.crop_size / w, p.crop_size / h
        boxes = None
        if p.boxes != "detector":
            raw = self.boxes.get(row)
            if isinstance(raw, str) or raw is None:
                raise ValueError(raw or f"no boxes for row {row} in {p.boxes}")
            boxes = check_boxes(raw, w, h)[:p.max_regions] * np.array([sx, sy, sx, sy], dtype=np.float32)
        return Item(row, crops, boxes=boxes, scale=(sx, sy))


    def _check_inside_root(self, path: str) -> None:
        """Refuse a file that now resolves outside the image root (e.g. swapped for a symlink after ingest)."""
        from ..storage.sources import shards
        from ..storage.sources.common import escapes_root

        if self.root is None or shards.is_ref(path):
            return
        target, root = os.path.realpath(path), str(self.root)   # self.root is resolved already
        if target.startswith(root.rstrip(os.sep) + os.sep):
            return
        why = escapes_root(self.root, path)   # the exact check, and its message
        if why:
            raise ImageError(f"cannot read {path}: it {why} (a symlink pointing out?); refusing to read files "
                             f"outside the image root (ingest with --allow-outside-root if this is intended)")


def decode(path: str, plan: Plan | None = None, data: bytes | None = None):
    """One image file (or an image inside a shard): with the ``plan`` of a crop kind (global, fne,
    grid), its uint8 NHWC crops (n_crops, H, W, 3), decoded with ``plan.decoder``
    (:func:`vsekit.extract.images.decode_crops`); without, or for regions, the 8-bit RGB PIL image.
    The plan's pixel budgets apply; ``data``: the image's bytes, fetched already (object storage).
    Tests wrap it (a decoder that crashes its process)."""
    decoded_max = plan.setting("max_decoded_pixels") if plan is not None else None
    if plan is None or plan.kind == "regions":
        return load_image(path, decoded_max, data)
    return decode_crops(path, plan.resize, plan.crop_size, plan.crops, plan.resize_mode, plan.interpolation,
                        decoder=plan.decoder, max_decoded=decoded_max, max_resized=plan.setting("max_resized_pixels"),
                        data=data)


class Batch(list):
    """The items of one batch, their crops stacked into one uint8 tensor where they were decoded.

    Collated in the decoding process, the tensor reaches the driving process through shared memory
    (no pickled arrays through a pipe, no stacking in the thread that drives the model), and with
    ``pin`` a DataLoader's pin thread copies it into page-locked memory (:meth:`pin_memory`).
    """

    crops = None   # uint8 (B_ok, n_crops, H, W, 3) (regions: CHW) of the ok items, in order; their .crops are None
    stamp = None   # crops in a worker's ring buffer: the number the worker stamped after them (BufferRing)

    def pin_memory(self, *args) -> "Batch":
        if self.crops is not None:
            self.crops = self.crops.pin_memory()
            self.stamp = None   # a copy of ours now: the ring buffer may be reused
        return self

    def intact(self) -> bool:
        """Whether the crops are still this batch's: False only if the decoding worker has written
        another batch into their ring buffer meanwhile (which the ring's size rules out; checked
        before a batch's features are kept, so that a wrong feature is never written)."""
        return self.stamp is None or self.crops is None or BufferRing.stamp_of(self.crops) == self.stamp


class BufferRing:
    """A decoding worker's batch buffers in shared memory, reused in turn.

    A fresh shared segment per batch (what torch's default collate makes) costs the driving process
    an unmap and the freeing of every page of the batch (48 MB per 32 x 10-crop batch: 0.4 ms per
    image, issue 37) and the worker a page fault per page. Reused, each segment is mapped once in
    the driving process (torch keeps the mapping of a storage it is sent again while the storage is
    alive there, and its cache of received storages holds them weakly: :func:`iter_batches` holds the
    last ones) and its pages are faulted in once.

    A DataLoader hands a worker its next batch only when the driving process takes a batch: with
    ``prefetch`` batches per worker in flight, when a worker is handed batch ``j`` the driving
    process has finished every batch before ``j - prefetch * workers``; a worker's ``prefetch + 1``
    buffers in turn therefore never overwrite a batch the driving process still reads. As a second
    guard, each buffer carries the number of the batch last written into it (8 bytes after its
    data) and the driving process checks it before it keeps the batch's features (:meth:`Batch.intact`).
    """

    def __init__(self, size: int):
        self.size = int(size)
        self.slots: list = []
        self.turn = 0
        self.count = 0

    def take(self, shape: tuple[int, ...]):
        """A uint8 tensor of ``shape`` in the next buffer (grown if it is too small), and its stamp."""
        import torch

        numel = int(np.prod(shape))
        need = -(-numel // 8) * 8 + 8   # the data, 8-aligned, then the stamp
        k = self.turn % self.size
        self.turn += 1
        if k == len(self.slots):
            self.slots.append(None)
        if self.slots[k] is None or self.slots[k].nbytes() < need:
            self.slots[k] = torch.UntypedStorage._new_shared(need)
        storage = self.slots[k]
        self.count += 1
        stamp = (os.getpid() << 32) | self.count
        torch.empty(0, dtype=torch.int64).set_(storage, storage.nbytes() // 8 - 1, (1,))[0] = stamp
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape), stamp

    @staticmethod
    def stamp_of(crops) -> int:
        import torch

        storage = crops.untyped_storage()
        return int(torch.empty(0, dtype=torch.int64).set_(storage, storage.nbytes() // 8 - 1, (1,))[0])


_RING: BufferRing | None = None   # this decoding worker's (a DataLoader worker is a fresh process)


def collate(items: list[Item], ring: int = 0) -> Batch:
    """Stack the ok items' crops once, here (see :class:`Batch`); items of different shapes (BUTD's
    original-size images) keep their own. ``ring`` > 0 in a decoding worker: into that worker's
    :class:`BufferRing` of ``ring`` buffers."""
    batch = Batch(items)
    ok = [it for it in items if isinstance(it, Item) and it.error is None and it.crops is not None]
    if ok and len({it.crops.shape for it in ok}) == 1:
        out, batch.stamp = batch_tensor((len(ok),) + ok[0].crops.shape, ring)
        dst = out.numpy()
        for k, it in enumerate(ok):
            dst[k] = it.crops
            it.crops = None
        batch.crops = out
    return batch


def batch_tensor(shape: tuple[int, ...], ring: int = 0):
    """An uninitialised uint8 tensor of ``shape`` and its ring stamp (or None). Inside a DataLoader
    worker it is in shared memory from the start (as torch's default collate does), so that sending it
    to the driving process does not copy it into shared memory a second time; with ``ring`` > 0, in
    the worker's next :class:`BufferRing` buffer."""
    import torch
    from torch.utils.data import get_worker_info

    global _RING
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8), None
    if ring > 0:
        if _RING is None or _RING.size != ring:
            _RING = BufferRing(ring)
        return _RING.take(shape)
    numel = int(np.prod(shape))
    storage = torch.UntypedStorage._new_shared(numel)
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape), None


def stack(items: list[Item]):
    """The ok items' crops as one uint8 tensor (B, n_crops, H, W, 3); regions (B, 1, 3, H, W); or None."""
    import torch

    if getattr(items, "crops", None) is not None:
        return items.crops
    ok = [it.crops for it in items if it.error is None]
    return torch.from_numpy(np.stack(ok)) if ok else None


def iter_batches(dataset: RowDataset, batches: Sequence[Sequence[int]], workers: int,
                 pin: bool = False, prefetch: int = 2) -> Iterator[list[Item]]:
    """Yield the items of each batch of dataset indices, in order.

    If a decoding process dies (a segfault in a codec, the OOM killer), the batches that were in
    flight are decoded again one image at a time in a fresh single process; an image that kills
    that process too is reported failed and the run goes on.
    """
    pos, batches = 0, [list(b) for b in batches]
    if workers <= 0:
        many = getattr(dataset, "__getitems__", None)
        yield from (collate(many(b) if many else [dataset[i] for i in b]) for b in batches)
        return
    from collections import deque

    from torch.utils.data import DataLoader

    from ..storage.sources import remote

    while pos < len(batches):
        if getattr(dataset, "options", None) is not None:
            dataset.batches, dataset._at = batches[pos:], None   # so that each worker fetches its next batch ahead
        # each worker's batches in a ring of prefetch + 1 shared buffers (BufferRing), held mapped here
        loader = DataLoader(dataset, batch_sampler=batches[pos:], num_workers=workers, pin_memory=pin,
                            collate_fn=functools.partial(collate, ring=prefetch + 1), prefetch_factor=prefetch,
                            **workers_of(dataset))
        held = deque(maxlen=(prefetch + 1) * workers)   # the storages last received: found mapped when sent again
        try:
            for items in loader:
                if getattr(items, "stamp", None) is not None:
                    held.append(items.crops.untyped_storage())
                if items and items[0].reads:
                    remote.STATS.update(items[0].reads)
                yield items
                pos += 1
        except RuntimeError as exc:
            if not is_worker_death(exc):
                raise
            in_flight = batches[pos:pos + prefetch * workers]
            for b in in_flight:
                yield _isolated(dataset, b)
                pos += 1


def _isolated(dataset: RowDataset, indices: list[int]) -> list[Item]:
    from torch.utils.data import DataLoader

    got: dict[int, Item] = {}
    rest = list(indices)
    while rest:
        try:
            loader = DataLoader(dataset, batch_sampler=[[i] for i in rest], num_workers=1,
                                collate_fn=_first, prefetch_factor=1, **workers_of(dataset))
            for item in loader:
                got[rest.pop(0)] = item
        except RuntimeError as exc:
            bad = rest.pop(0)
            got[bad] = Item(dataset.rows[bad], None,
                            f"decoding {dataset.paths[bad]} crashed its worker process ({exc})")
    return [got[i] for i in indices]


@functools.lru_cache(maxsize=None)
def _fetcher():
    """The one thread of a decoding process that fetches its next batch (:meth:`RowDataset._fetched`)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="vsekit-fetch-ahead")


def _first(items):
    return items[0]


PARENT_CHECK_S = 1.0   # how often a decoding worker checks that its parent is alive (the fallback)
#: what a fork server imports once, so that a worker it forks starts in milliseconds
PRELOAD = ["torch", "torchvision.io", "PIL.Image", "vsekit.extract.reader", "vsekit.storage.sources.remote"]


def workers_of(dataset) -> dict:
    """The DataLoader arguments that start ``dataset``'s decoding workers: forked, or, where its images
    are on object storage, forked by a fork server (obstore's runtime does not survive a fork of a
    process that used it: a forked worker's first request hangs), which is given this process's
    environment (the credentials obstore reads there; the options travel on the dataset)."""
    if getattr(dataset, "options", None) is None:
        return {"worker_init_fn": functools.partial(_die_with_parent, os.getpid(), None)}
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return {"worker_init_fn": functools.partial(_die_with_parent, os.getpid(), dict(os.environ)),
            "multiprocessing_context": ctx}


def _gone(parent: int) -> bool:
    """Whether process ``parent`` has ended (a forked worker's parent changes; a fork server's child
    has the server as its parent, so it asks after ``parent`` itself)."""
    if os.getppid() == parent:
        return False
    try:
        os.kill(parent, 0)
    except OSError:   # no such process (or another user's: its pid was reused)
        return True
    return False


def _die_with_parent(parent: int, env: dict | None = None, worker_id: int = 0) -> None:
    """A decoding worker's ``worker_init_fn``: end it when process ``parent`` ends (and, with ``env``,
    give it that environment). However the main process ends (SIGTERM, ``kill -9``, OOM killer), its
    decoding workers must not live on: one blocked writing to a full result pipe never reaches torch's
    own parent check. On Linux the kernel sends the worker SIGKILL when its parent dies
    (``PR_SET_PDEATHSIG``; a fork server's child: when the server dies, which it does when ``parent``
    does); as a fallback everywhere, a daemon thread in the worker exits it once ``parent`` is gone."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if _gone(parent):   # the parent died before the line above took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="vsekit-parent-check", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if _gone(parent):
            os._exit(1)


def is_worker_death(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "DataLoader worker" in str(exc)


def survive_worker_death(fn, *args, attempts: int = 4):
    """Call ``fn(*args)``, calling it again if a decoding process's death interrupts it.

    torch reports a dead DataLoader worker from its SIGCHLD handler, which raises in the main
    thread wherever it is, often inside the model's forward pass on a batch that was already
    decoded. That batch is complete, so it is simply run again; ``iter_batches`` recovers the
    batches that were in flight when the worker died. ``fn`` must be safe to repeat.
    """
    for attempt in range(attempts):
        try:
            return fn(*args)
        except RuntimeError as exc:
            if not is_worker_death(exc) or attempt == attempts - 1:
                raise


def decoded(dataset, batches: Sequence[Sequence[int]], workers: int, pin: bool = False,
            prefetch: int = 2, threads: bool = False) -> Iterator[list[Item]]:
    """The items of each batch (a :class:`Batch`), in order, decoded by ``workers`` processes (their
    batches pinned by the DataLoader's pin thread with ``pin``), or by threads with ``threads`` (a
    dask worker is a daemon process, which may not have children: :func:`vsekit.extract.site.resolve`
    says so)."""
    if workers > 0 and threads:
        return decoded_by_threads(dataset, batches, workers, prefetch)
    return iter_batches(dataset, batches, workers, pin, prefetch)


def decoded_by_threads(dataset, batches: Sequence[Sequence[int]], threads: int,
                       prefetch: int = 2) -> Iterator[list[Item]]:
    """The items of each batch, in order, decoded by ``threads`` threads (0/1: in this thread).

    Decoding (PIL, numpy) releases the GIL, and at most ``prefetch`` batches are decoded ahead.
    """
    if threads <= 1:
        yield from iter_batches(dataset, batches, 0)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    def collated(futures):
        return collate([f.result() for f in futures])

    def item(i, fetched):
        return dataset.item(i, fetched.result()) if fetched else dataset[i]

    # the items on `threads` threads; each batch collated, in order, by one more (it only waits on them);
    # a batch's images on object storage fetched together first, by one more
    with ThreadPoolExecutor(threads, thread_name_prefix="vsekit-decode") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="vsekit-collate") as collator, \
            ThreadPoolExecutor(1, thread_name_prefix="vsekit-fetch") as fetcher:
        ahead: deque = deque()
        for b in batches:
            fetched = fetcher.submit(dataset.fetch, b) if hasattr(dataset, "fetch") else None
            ahead.append(collator.submit(collated, [pool.submit(item, i, fetched) for i in b]))
            if len(ahead) > prefetch:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


