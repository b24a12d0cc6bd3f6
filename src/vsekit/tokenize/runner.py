"""``vsekit tokenize``: every caption → vocabulary ids in the flat ``tokens/ids`` + ``tokens/offsets``.

Two streaming passes, so memory is bounded by the chunk sizes, not by the number of captions: *count*
(parallel over chunks of captions; each task stages its captions' chunk-local ids and word list in
arrays of its own) and *encode* (the driver maps them to vocabulary ids and writes them in order).
Everything is built in ``tokens_partial/`` and swapped into ``tokens/`` only when complete
(docs/tokenize.md, "How it runs").
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import zarr

from ..storage.faults import point
from ..storage.ref import StoreRef
from ..storage.objstore import TOKENS_SWAP as SWAP_MARK  # noqa: F401 (on object storage: a swap to finish; tests name it)
from ..storage.base import no_tokens
from ..storage.store import SPLITS, FeatureStore, StoreError, config_hash, split_code, write_array
from ..version import __version__
from .text import tokenize_caption
from .vocab import END, SPECIALS, START, UNK, Vocabulary, check_max_len, truncate_length

STAGING = "tokens_partial"
CHUNK_CAPTIONS = 16384      # captions per count task
CHUNK_TOKENS = 1 << 18      # ids per chunk of tokens/ids (1 MiB of int32)
CHUNK_OFFSETS = 65536       # offsets per chunk of tokens/offsets


@dataclass
class TokenizeSummary:
    """What ``tokenize`` did; ``str()`` is the CLI's report."""

    store: str
    captions: int
    tokens: int
    vocabulary: int
    vocab_splits: list[str]
    vocab_captions: int
    empty: int
    truncated: int
    unknown: int
    min_count: int = 0

    def __str__(self) -> str:
        return (f"tokenized {self.captions} captions into {self.tokens} tokens in {self.store}\n"
                f"  vocabulary: {self.vocabulary} words (specials included) from {self.vocab_captions} "
                f"captions of {','.join(self.vocab_splits)}\n"
                f"  empty captions: {self.empty}, truncated: {self.truncated}, <unk> tokens: {self.unknown}"
                + (f" of {self.tokens} ({100 * self.unknown / self.tokens:.0f}%: words seen fewer than "
                   f"--min-count {self.min_count} times in {','.join(self.vocab_splits)} are <unk>; "
                   f"a small store needs a lower --min-count)"
                   if self.tokens and self.min_count and self.unknown / self.tokens >= 0.05 else ""))


def resolve_vocab_splits(spec: str | Sequence[str]) -> list[str]:
    """``"train,val"`` → ``["train", "val", "restval"]``: restval counts with train; test is refused."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if str(s).strip()]
    if not names:
        raise ValueError(f"--vocab-splits is empty; choose from {', '.join(s for s in SPLITS if s != 'test')}")
    codes = {split_code(s) for s in names}
    if split_code("test") in codes:
        raise ValueError("--vocab-splits must not include test: a vocabulary built from test captions "
                         "leaks test words into training (VSE++ did this); use e.g. train,val")
    if split_code("train") in codes:
        codes.add(split_code("restval"))
    return [SPLITS[c] for c in sorted(codes)]


def tokenize(store: FeatureStore | str | os.PathLike, *, min_count: int = 4,
             vocab_splits: str | Sequence[str] = "train,val", strip_punct: bool = False,
             lowercase: bool = True, bos_eos: bool = True, max_len: int | None = None,
             workers: int = 1, cluster: "ClusterSpec | str | None" = None, chunk_captions: int = CHUNK_CAPTIONS,
             chunk_tokens: int = CHUNK_TOKENS,
             progress: Callable[[int, int], None] | None = None) -> TokenizeSummary:
    """Tokenise every caption of ``store``, build the vocabulary, and write the ``tokens`` group.

    ``workers`` > 1 runs the count pass in that many processes; ``cluster`` (``local:N`` or
    ``tcp://HOST:PORT``) runs it on dask instead. On object storage both need a provider that
    honours conditional writes (several processes write the staging objects under the run's lease). ``max_len`` counts ``<start>`` and ``<end>``.
    ``progress(done, total)`` is called after each chunk of captions.
    """
    if isinstance(store, FeatureStore):
        store = FeatureStore.open(store.path, mode="r+", storage_options=store.sets.options())
    else:
        store = FeatureStore.open(store, mode="r+")
    if cluster:   # on object storage its tasks open the URL with the options handed to them (storage/ref.py)
        cluster = store.sets.check_cluster(cluster, "tokenize")
    if workers > 1 and str(store.path).startswith("memory://"):
        raise StoreError(f"--workers {workers}: a memory:// store lives in this process only, where no worker "
                         f"process can reach it; run without --workers")
    # one tokenize at a time: a second run would delete the first one's ``tokens_partial``
    with store.writer("tokens", stage="vsekit tokenize", multi=bool(cluster) or workers > 1):
        n_captions = store.n_captions
        if n_captions == 0:
            raise StoreError(f"{store.path} has no captions to tokenize; ingest a captioned dataset first")
        splits = resolve_vocab_splits(vocab_splits)
        check_max_len(max_len, bos_eos)
        if min_count < 1:
            raise ValueError(f"--min-count must be at least 1, got {min_count}")
        if chunk_captions < 1 or chunk_tokens < 1:
            raise ValueError("chunk sizes must be at least 1")
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        settings = {"lowercase": bool(lowercase), "strip_punct": bool(strip_punct), "bos_eos": bool(bos_eos),
                    "max_len": None if max_len is None else int(max_len)}

        root = store.root
        store.sets.finish_group_swap("tokens", "tokens", "tokenize")   # a run killed while it replaced the tokens
        point("tokenize:staging")
        if STAGING in root:   # left by a killed run (no live one: we hold the lock)
            del root[STAGING]
        staging = root.create_group(STAGING)
        staging.create_group("stage")
        bounds = [(s, min(s + chunk_captions, n_captions)) for s in range(0, n_captions, chunk_captions)]
        codes = [split_code(s) for s in splits]
        # tasks in other processes open the store as they reach it (its absolute path; on object storage the URL
        # with the options and the lease token they carry: storage/ref.py), in-process ones use its zarr store
        where: Any = StoreRef.of(store) if cluster or workers > 1 else store.root.store
        tasks = [{"store": where, "index": i, "start": a, "stop": b, "codes": codes, **settings}
                 for i, (a, b) in enumerate(bounds)]

        counts: Counter[str] = Counter()
        n_tokens = empty = truncated = vocab_captions = 0
        for done, res in enumerate(_map_ordered(count_chunk, tasks, workers, cluster), 1):
            counts.update(res["counts"])
            n_tokens += res["tokens"]
            empty += res["empty"]
            truncated += res["truncated"]
            vocab_captions += res["vocab_captions"]
            if progress:
                progress(done, len(tasks))
        if vocab_captions == 0:
            del root[STAGING]
            raise StoreError(f"{store.path} has no captions in the vocabulary splits {','.join(splits)}; "
                             f"choose others with --vocab-splits")

        vocab = Vocabulary.from_counts(counts, min_count, **settings)
        ids = staging.create_array("ids", shape=(n_tokens,), dtype=np.int32,
                                   chunks=(max(1, min(chunk_tokens, n_tokens)),), fill_value=0)
        offsets = staging.create_array("offsets", shape=(n_captions + 1,), dtype=np.int64,
                                       chunks=(min(CHUNK_OFFSETS, n_captions + 1),), fill_value=0)
        unknown = _encode_pass(staging, len(tasks), vocab, bos_eos, ids, offsets)

        staging.update_attributes({   # one write of zarr.json, not one per key
            "vocabulary": vocab.itos,
            "counts": [0] * len(SPECIALS) + [int(counts[w]) for w in vocab.itos[len(SPECIALS):]],
            "specials": list(SPECIALS),
            "min_count": int(min_count),
            "vocab_splits": splits,
            **settings,
            "tokenizer": f"nltk.NLTKWordTokenizer {_nltk_version()}",
            "n_captions": n_captions,
            "n_tokens": n_tokens,
            "n_empty": empty,
            "n_truncated": truncated,
            "n_unknown": unknown,
            "vocab_captions": vocab_captions,
            "code_version": __version__,
            "config_hash": config_hash({"min_count": int(min_count), "vocab_splits": splits, **settings,
                                        "tokenizer": _nltk_version()}),
        })
        del staging["stage"]
        point("tokenize:swap")   # a rename on a disk; a marked copy the next tokenize finishes on object storage
        store.sets.swap_group(STAGING, "tokens", "tokens", "tokenize")
        return TokenizeSummary(store=str(store.path), captions=n_captions, tokens=n_tokens,
                               vocabulary=len(vocab), vocab_splits=splits, vocab_captions=vocab_captions,
                               empty=empty, truncated=truncated, unknown=unknown, min_count=int(min_count))


# pass 1: count (runs in worker processes) ---------------------------------------------------------
def count_chunk(task: dict[str, Any]) -> dict[str, Any]:
    """Tokenise captions ``[start, stop)``; stage their local ids; return word counts and stats.

    On object storage a task in another process stages its ids only while its driver holds the
    ``tokens`` lease (it may have been handed out by a run that has since stopped)."""
    ref = task["store"] if isinstance(task["store"], StoreRef) else None
    store = ref.open() if ref is not None else None
    root = store.root if store is not None else zarr.open_group(task["store"], mode="r+", zarr_format=3)
    start, stop = task["start"], task["stop"]
    texts = root["captions/text"][start:stop]
    owners = np.asarray(root["captions/image"][start:stop], dtype=np.int64)
    in_vocab = np.isin(np.asarray(root["images/split"][:])[owners], task["codes"])
    bos_eos, max_len = task["bos_eos"], task["max_len"]

    vocab_words: list[str] = []   # every word of the vocabulary-split captions
    kept_words: list[str] = []    # the words each caption keeps after --max-len
    lengths = np.zeros(stop - start, dtype=np.int32)
    empty = truncated = 0
    for k, text in enumerate(texts):
        words = tokenize_caption(str(text), lowercase=task["lowercase"], strip_punct=task["strip_punct"])
        if not words:
            empty += 1
            continue
        if in_vocab[k]:
            vocab_words += words
        keep = truncate_length(len(words), bos_eos=bos_eos, max_len=max_len)
        if keep < len(words):
            truncated += 1
            words = words[:keep]
        kept_words += words
        lengths[k] = keep
    counts = dict(Counter(vocab_words))
    local = {w: i for i, w in enumerate(dict.fromkeys(kept_words))}   # first-appearance order
    local_ids = list(map(local.__getitem__, kept_words))

    if store is not None:   # another process: its driver must still hold the lease (on a disk: never lost)
        store.check_lease("tokens")
    g = root[f"{STAGING}/stage"].create_group(f"{task['index']:06d}", overwrite=True)
    g.attrs["words"] = list(local)
    for name, values in (("ids", np.asarray(local_ids, dtype=np.int32)), ("lengths", lengths)):
        write_array(g, name, values, chunk=max(1, len(values)))   # one chunk
    n_final = int(lengths.sum()) + (2 * int(np.count_nonzero(lengths)) if bos_eos else 0)
    return {"index": task["index"], "counts": counts, "tokens": n_final, "empty": empty,
            "truncated": int(truncated), "vocab_captions": int(in_vocab.sum())}


def _map_ordered(func: Callable[[Any], Any], tasks: list, workers: int, cluster: "ClusterSpec | str | None") -> Iterator[Any]:
    """``func`` over ``tasks``, results in task order: in-process, in processes, or on dask."""
    if cluster:
        from ..clusters import cluster_client

        with cluster_client(cluster) as client:
            futures = client.map(func, tasks, pure=False, retries=2)
            for fut in futures:
                yield fut.result()
                fut.release()
        return
    if workers > 1 and len(tasks) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: the parent's zarr I/O thread must not be forked mid-flight
        with ProcessPoolExecutor(max_workers=min(workers, len(tasks)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            yield from pool.map(func, tasks)
        return
    for task in tasks:
        yield func(task)


# pass 2: encode (driver) --------------------------------------------------------------------------
def _encode_pass(staging: zarr.Group, n_chunks: int, vocab: Vocabulary, bos_eos: bool,
                 ids: zarr.Array, offsets: zarr.Array) -> int:
    """Map every staged chunk to vocabulary ids and write them out in order (zarr completes the chunks a
    write covers in part); returns the ``<unk>`` count."""
    running = row = unknown = 0   # offsets[0] is its fill value, 0
    stage = staging["stage"]
    for i in range(n_chunks):
        g = stage[f"{i:06d}"]
        words = g.attrs["words"]
        lut = np.fromiter((vocab.stoi.get(w, UNK) for w in words), dtype=np.int32, count=len(words))
        gids = lut[g["ids"][:]]
        unknown += int(np.count_nonzero(gids == UNK))
        flat, lengths = with_bos_eos(gids, g["lengths"][:], bos_eos)
        ids[running:running + len(flat)] = flat
        offsets[row + 1:row + 1 + len(lengths)] = running + np.cumsum(lengths, dtype=np.int64)
        running, row = running + len(flat), row + len(lengths)
    if running != ids.shape[0] or row + 1 != offsets.shape[0]:  # pragma: no cover - internal check
        raise StoreError(f"tokenize: wrote {running} ids for {ids.shape[0]} expected; the staging "
                         f"arrays changed during the run")
    return unknown


def with_bos_eos(word_ids: np.ndarray, lengths: np.ndarray, bos_eos: bool) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated word ids of captions with ``lengths`` words → with ``<start>``/``<end>`` around
    each non-empty caption; returns (flat ids, per-caption lengths)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not bos_eos:
        return np.asarray(word_ids, dtype=np.int32), lengths
    nonempty = lengths > 0
    final = lengths + 2 * nonempty
    starts = np.cumsum(final) - final
    out = np.empty(int(final.sum()), dtype=np.int32)
    out[starts[nonempty]] = START
    out[(starts + final - 1)[nonempty]] = END
    word_starts = np.cumsum(lengths) - lengths
    within = np.arange(int(lengths.sum())) - np.repeat(word_starts, lengths)
    out[np.repeat(starts + 1, lengths) + within] = word_ids
    return out, final


def _nltk_version() -> str:
    import nltk

    return str(nltk.__version__)


# reading ------------------------------------------------------------------------------------------
def caption_tokens(store: FeatureStore | str | os.PathLike, rows: Iterable[int]) -> list[np.ndarray]:
    """The stored ids of the captions ``rows`` (one int32 array each)."""
    if not isinstance(store, FeatureStore):
        store = FeatureStore.open(store)
    if not store.has_tokens:
        raise StoreError(no_tokens(store.path))
    ids, offsets = store.root["tokens/ids"], store.root["tokens/offsets"]
    n = offsets.shape[0] - 1
    out = []
    for m in rows:
        m = int(m)
        if not 0 <= m < n:
            raise ValueError(f"caption row {m} is outside 0..{n - 1}")
        a, b = (int(v) for v in offsets[m:m + 2])
        out.append(np.asarray(ids[a:b], dtype=np.int32))
    return out
