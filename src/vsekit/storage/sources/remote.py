"""Images on object storage (issue 46; docs/store.md, "Images on object storage").

An image root, a shard or a loose image may be a URL (``s3://``, ``az://``, ``gs://``, ``memory://``).
It is opened with obstore through the same function that opens stores
(:func:`vsekit.storage.objstore._open_obstore`), with the images' own options (``--image-option``,
:data:`IMAGE_OPTIONS`) or else the store's (``--storage-option``); they stay in memory.

A batch's images are fetched at once (:func:`fetch`): the members of one tar shard whose byte ranges
lie within :data:`GAP` of each other are one ranged GET (from the 512-byte header before the first
to the end of the last, checked as :mod:`.shards` checks a local read), a loose image one GET, with
at most ``read_requests`` requests in flight. Where ingest recorded a shard's ETag the GET carries
``If-Match``, so a shard rewritten since ingest is refused by the server, not decoded as another
image. A transient failure (HTTP 5xx, a reset, a timeout; ``--image-option timeout=...`` bounds a
stalled response) is retried with backoff, ``max_retries`` times: by this loop, not obstore's, so
that each retry is counted (:data:`STATS`, in the run's summary); obstore's own retries are off.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping, NamedTuple

from ..base import ImageError
from ..objstore import DEFAULT_OPTIONS, _open_obstore, _reason, is_object_url, parse_options, public_url

#: ``--image-option KEY=VALUE`` values of this process's command; empty: the store's options
IMAGE_OPTIONS: dict[str, str] = {}
READ_REQUESTS = 8            # GETs in flight per decoding process (``--image-option read_requests=N``)
MAX_RETRIES = 3              # retries of a transient failure (``--image-option max_retries=N``)
GAP = 1 << 20                # members this close in one shard share a GET (object_store's coalescing gap)
SPAN = 64 << 20              # at most this many bytes in one GET
#: requests, bytes and retries of this process (a worker returns its own; the run sums them)
STATS: Counter = Counter()
_LOCK = threading.Lock()
_PARQUET = threading.RLock()   # the parquet files this process keeps open (shards._parquet): one reader at a time
_STORES: dict = {}
_TRANSIENT = re.compile(r"\b50[0-4]\b|timed? ?out|reset|connection|broken pipe|unavailable|slow ?down", re.I)


def _without_urls(exc: BaseException) -> str:
    """An error's message less the URLs in it, whose bucket, key or port may hold any digits (a bucket
    ``vsekit-416d…`` is not an HTTP 416): what is left says the status."""
    return re.sub(r"\S+://\S+", "", str(exc))


def is_url(path) -> bool:
    return is_object_url(str(path))


def options() -> dict[str, str]:
    """The options the images are opened with: ``--image-option``'s, else ``--storage-option``'s."""
    return dict(IMAGE_OPTIONS or DEFAULT_OPTIONS)


def use_options(opts: Mapping[str, str] | None) -> None:
    """Make ``opts`` this process's image options (a task, given them in memory by its driver)."""
    IMAGE_OPTIONS.clear()
    IMAGE_OPTIONS.update(parse_options(opts or {}))


def image_url(store) -> str | None:
    """The store's image root where it is on object storage (a URL), else None."""
    url = store.attrs.get("image_root") or ""
    return url if is_url(url) else None


def join(root: str, rel: str) -> str:
    """An image's location: ``rel`` under ``root`` (a URL or a folder)."""
    return f"{root.rstrip('/')}/{rel}" if is_url(root) else str(root).rstrip("/") + "/" + rel


def common_root(urls: list[str]) -> str:
    """The folder on object storage that holds every one of ``urls`` (one scheme and bucket)."""
    scheme = urls[0].split("://", 1)[0]
    return f"{scheme}://" + os.path.commonpath([u.split("://", 1)[1].rsplit("/", 1)[0] for u in urls])


def _split(url: str) -> tuple[str, str]:
    m = re.match(r"^([A-Za-z0-9+.-]+://[^/]*)/?(.*)$", public_url(url))
    return m.group(1), m.group(2)


def _setting(opts: Mapping[str, str], key: str, default: int) -> int:
    try:
        value = int(opts.get(key, default))
        if value >= (1 if key == "read_requests" else 0):
            return value
    except ValueError:
        pass
    raise ValueError(f"--image-option {key} must be a whole number (got {opts.get(key)!r})")


def store_of(url: str, opts: Mapping[str, str] | None = None):
    """(obstore store of the URL's bucket or container, the object's key); one store per process."""
    opts = options() if opts is None else dict(opts)
    bucket, key = _split(url)
    cache = (os.getpid(), bucket, tuple(sorted(opts.items())))   # a forked decoding worker opens its own
    with _LOCK:
        if cache not in _STORES:   # our loop retries (and counts): obstore's retries off
            _STORES[cache] = _open_obstore(bucket, {**opts, "max_retries": "0"})
        return _STORES[cache], key


def get(url: str, rng: tuple[int, int] | None = None, etag: str | None = None, opts=None) -> tuple[bytes, dict]:
    """The object's bytes (``rng``: only [start, end)) and its metadata, retrying transient failures.
    A missing object is FileNotFoundError; any other failure ImageError saying why (the caller names
    the object: a failed row's reason starts ``cannot read URL``, which --retry-failed retries)."""
    import obstore
    from obstore.exceptions import PreconditionError

    opts = options() if opts is None else opts
    store, key = store_of(url, opts)
    ask = {**({"range": rng} if rng else {}), **({"if_match": etag} if etag else {})}
    retries = _setting(opts, "max_retries", MAX_RETRIES)
    for attempt in range(retries + 1):
        try:
            res = obstore.get(store, key, options=ask or None)
            data = bytes(res.bytes())
            with _LOCK:
                STATS["requests"] += 1
                STATS["bytes"] += len(data)
            return data, res.meta
        except PreconditionError:
            raise ImageError("it changed since it was ingested (its ETag is not the one recorded); ingest it "
                             "again") from None
        except FileNotFoundError:
            raise
        except Exception as exc:
            said = _without_urls(exc)
            if re.search(r"\b416\b", said):   # a range past its end: it is shorter than at ingest
                raise ImageError("it is shorter than when it was ingested: it changed since it was ingested "
                                 "(ingest it again)") from None
            if attempt == retries or not _TRANSIENT.search(said):
                raise ImageError(_reason(exc, url.split(':')[0])) from None
            with _LOCK:
                STATS["retries"] += 1
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
    raise AssertionError("unreachable")


def check_root(url: str) -> None:
    """One listing of the image root: bad credentials or a missing bucket is one StoreError line
    before any block runs."""
    import obstore

    from ..base import StoreError

    store, key = store_of(url)
    try:
        next(iter(obstore.list(store, prefix=key or None, chunk_size=1)), None)
    except Exception as exc:
        raise StoreError(f"image root {public_url(url)}: {_reason(exc, url.split(':')[0])}") from None


def listing(url: str) -> dict[str, int]:
    """Every object under the folder ``url`` (one listing, not a request per object): key relative to
    it → size."""
    import obstore

    store, key = store_of(url)
    prefix = key.rstrip("/") + "/" if key else ""
    try:
        return {m["path"][len(prefix):]: int(m["size"])
                for batch in obstore.list(store, prefix=prefix or None) for m in batch}
    except Exception as exc:
        raise ImageError(f"{public_url(url)}: cannot list it: {_reason(exc, url.split(':')[0])}") from None


class Stream(io.RawIOBase):
    """An object read start to end with one streamed GET (tarfile's stream mode reads it); its size
    and ETag in :attr:`meta`."""

    def __init__(self, url: str):
        import obstore

        store, key = store_of(url)
        try:
            res = obstore.get(store, key)
        except FileNotFoundError:
            raise ImageError(f"{public_url(url)}: no such object") from None
        except Exception as exc:
            raise ImageError(f"{public_url(url)}: cannot read it: {_reason(exc, url.split(':')[0])}") from None
        self.meta, self._chunks, self._left = res.meta, iter(res.stream(min_chunk_size=1 << 20)), b""
        with _LOCK:
            STATS["requests"] += 1

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = bytes(chunk)
            with _LOCK:
                STATS["bytes"] += len(self._left)
        n = min(len(buf), len(self._left))
        buf[:n], self._left = self._left[:n], self._left[n:]
        return n


class Ranged(io.RawIOBase):
    """An object read where it is asked, one ranged GET a read (pyarrow reads a parquet file's footer,
    then the column chunks it needs), with ``If-Match`` where its ETag is known. Not obstore's
    ``open_reader``: its ranged reads carry no ``If-Match`` and its retries are not counted."""

    def __init__(self, url: str, size: int | None = None, etag: str | None = None, opts=None):
        import obstore

        if size is None:
            size = obstore.head(*store_of(url, opts))["size"]
        self.url, self.size, self.etag, self.opts, self.pos = url, int(size), etag, opts, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = (pos, self.pos + pos, self.size + pos)[whence]
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        data = get(self.url, (self.pos, self.pos + n), self.etag, self.opts)[0]
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)


class Where(NamedTuple):
    """Where a parquet file on object storage is read from: its size and ETag at ingest and the options
    (hashable: :mod:`.shards` keeps the file open by it)."""

    size: int | None
    etag: str | None
    opts: tuple

    def reader(self, url: str) -> Ranged:
        return Ranged(url, self.size, self.etag, dict(self.opts))


def _runs(items: list[tuple]) -> list[list[tuple]]:
    """Tar members of one shard, sorted, cut into runs whose ranges lie within GAP (a run ≤ SPAN)."""
    runs: list[list[tuple]] = []
    for it in sorted(items):
        if runs and it[0] - runs[-1][-1][1] <= GAP and it[1] - runs[-1][0][0] <= SPAN:
            runs[-1].append(it)
        else:
            runs.append([it])
    return runs


def fetch(paths: Iterable[str], expected: Mapping[str, list] | None = None,
          opts: Mapping[str, str] | None = None) -> dict[str, bytes | ImageError]:
    """The bytes of each image ``paths`` names on object storage (a loose object, or a tar member
    ``URL.tar::MEMBER@OFFSET+SIZE``), or the ImageError that names its URL and member. ``expected``:
    a shard's [size, ETag] as ingest recorded them; ``opts``: the images' options (else this process's)."""
    from . import shards

    opts, expected = options() if opts is None else dict(opts), expected or {}
    out: dict[str, bytes | ImageError] = {}
    shard_items: dict[str, list] = {}
    loose: list[str] = []
    for p in dict.fromkeys(paths):
        if shards.is_ref(p) and shards.parse_ref(p)[0].lower().endswith(".tar"):
            container, member, loc = shards.parse_ref(p)
            try:
                offset, size = (int(x) for x in loc.split("+"))
            except ValueError:
                out[p] = ImageError(f"{p}: malformed tar location {loc!r} (OFFSET+SIZE)")
                continue
            shard_items.setdefault(container, []).append((max(0, offset - tarfile.BLOCKSIZE), offset + size, p,
                                                          member, offset, size))
        else:
            loose.append(p)

    def one_run(job):
        url, run = job
        size, etag = (expected.get(url) or (None, None))[:2]
        try:
            data, meta = get(url, (run[0][0], run[-1][1]), etag, opts)
            if size is not None and int(meta.get("size", size)) != int(size):
                raise ImageError(f"it is {meta.get('size')} bytes, not the {size} recorded: it changed since it "
                                 f"was ingested (ingest it again)")
        except (ImageError, FileNotFoundError) as exc:
            why = "no such object" if isinstance(exc, FileNotFoundError) else str(exc)
            return [(it[2], ImageError(f"cannot read {url} (member {it[3]}): {why}")) for it in run]
        base, got = run[0][0], []
        for start, _end, p, member, offset, length in run:
            head = data[start - base:offset - base]
            try:
                got.append((p, shards.check_member(url, member, offset, length, head,
                                                   data[offset - base:offset - base + length])))
            except ImageError as exc:
                got.append((p, ImageError(f"cannot read {exc}")))
        return got

    def one_loose(p):
        try:
            if shards.is_ref(p):   # a parquet cell: its row group's column chunk (kept for the next rows)
                url = shards.parse_ref(p)[0]
                where = Where(*(expected.get(url) or (None, None))[:2], tuple(sorted(opts.items())))
                with _PARQUET:
                    return [(p, shards.read_bytes(p, where))]
            return [(p, get(p, opts=opts)[0])]
        except FileNotFoundError:
            return [(p, ImageError(f"cannot read {public_url(p)}: no such object"))]
        except Exception as exc:   # ImageError, or pyarrow's error around it
            return [(p, ImageError(f"cannot read {public_url(p)}: {exc}"))]

    def cells_in_order(cells):
        # parquet cells in the batch's order under one hold of the lock: each row group's column is
        # read once for its rows (shards keeps one), not again when the pool's threads run out of order
        with _PARQUET:
            return [got for p in cells for got in one_loose(p)]

    cells, loose = [p for p in loose if shards.is_ref(p)], [p for p in loose if not shards.is_ref(p)]
    jobs = [(url, run) for url, items in shard_items.items() for run in _runs(items)]
    if not jobs and not loose and not cells:
        return out
    with ThreadPoolExecutor(_setting(opts, "read_requests", READ_REQUESTS), thread_name_prefix="vsekit-fetch") as pool:
        tasks = [pool.submit(one_run, j) for j in jobs] + [pool.submit(one_loose, p) for p in loose]
        for done in tasks + ([pool.submit(cells_in_order, cells)] if cells else []):
            out.update(done.result())
    return out


def image_bytes(path: str) -> bytes | None:
    """The encoded bytes of an image inside a container or on object storage (fetched alone, where no
    batch fetched it); None for a local file (the decoder opens it itself)."""
    from . import shards

    if not is_url(path):
        return shards.read_bytes(path) if shards.is_ref(path) else None
    got = fetch([path])[path]
    if isinstance(got, ImageError):
        raise got
    return got
