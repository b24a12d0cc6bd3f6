"""The word vocabulary: specials first, then words by frequency, then alphabetically.

Built as in VSE++ (Faghri et al., 2018, ``vocab.py``) and SCAN: words seen at least ``min_count``
times (4 in both) after ``<pad>``=0, ``<start>``=1, ``<end>``=2, ``<unk>``=3. VSE++ counts the words
of *all* captions, test included, so words that occur only in test captions get their own ids;
vsekit counts only the captions of the vocabulary splits (train and val by default), so such words
map to ``<unk>`` as they would for truly unseen text. VSE++ orders words by first appearance; vsekit
orders them by frequency and then alphabetically, which does not depend on caption order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .text import tokenize_caption

if TYPE_CHECKING:  # pragma: no cover
    from ..storage.store import FeatureStore

SPECIALS: tuple[str, ...] = ("<pad>", "<start>", "<end>", "<unk>")
PAD, START, END, UNK = 0, 1, 2, 3


def order_words(counts: Mapping[str, int], min_count: int) -> list[str]:
    """Words with ``count >= min_count``, most frequent first, ties alphabetically; no specials."""
    if min_count < 1:
        raise ValueError(f"--min-count must be at least 1, got {min_count}")
    kept = [(n, w) for w, n in counts.items() if n >= min_count and w not in SPECIALS]
    kept.sort(key=lambda item: (-item[0], item[1]))
    return [w for _, w in kept]


def truncate_length(n_words: int, *, bos_eos: bool, max_len: int | None) -> int:
    """How many of a caption's ``n_words`` words are kept under ``max_len`` (which counts
    ``<start>``/``<end>``)."""
    if max_len is None:
        return n_words
    return min(n_words, max_len - 2 if bos_eos else max_len)


def check_max_len(max_len: int | None, bos_eos: bool) -> None:
    low = 3 if bos_eos else 1
    if max_len is not None and max_len < low:
        raise ValueError(f"--max-len must be at least {low}"
                         f"{' (it counts <start> and <end>)' if bos_eos else ''}, got {max_len}")


class Vocabulary:
    """Word ↔ id maps plus the tokenisation settings, so ``encode`` matches the stored ids."""

    def __init__(self, itos: Sequence[str], *, lowercase: bool = True, strip_punct: bool = False,
                 bos_eos: bool = True, max_len: int | None = None):
        itos = [str(w) for w in itos]
        if tuple(itos[:len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary must start with the specials {list(SPECIALS)}, "
                             f"got {itos[:len(SPECIALS)]}")
        if len(set(itos)) != len(itos):
            raise ValueError("a vocabulary must not repeat a word")
        check_max_len(max_len, bos_eos)
        self.itos: list[str] = itos
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(itos)}
        self.lowercase, self.strip_punct = bool(lowercase), bool(strip_punct)
        self.bos_eos, self.max_len = bool(bos_eos), max_len

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], min_count: int = 4, **settings: Any) -> "Vocabulary":
        return cls([*SPECIALS, *order_words(counts, min_count)], **settings)

    @classmethod
    def from_store(cls, store: "FeatureStore | str | os.PathLike") -> "Vocabulary":
        """The vocabulary ``vsekit tokenize`` stored in ``store`` (a FeatureStore or a path)."""
        from ..storage.interop import stored_vocabulary
        from ..storage.store import FeatureStore

        if not isinstance(store, FeatureStore):
            store = FeatureStore.open(store)
        stored_vocabulary(store)   # refuses a store without one
        a = store.root["tokens"].attrs
        return cls(a["vocabulary"], lowercase=a.get("lowercase", True), strip_punct=a.get("strip_punct", False),
                   bos_eos=a.get("bos_eos", True), max_len=a.get("max_len"))

    # ids ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, word: object) -> bool:
        return word in self.stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.itos == other.itos and self.settings() == other.settings()

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} words, {self.settings()})"

    def settings(self) -> dict[str, Any]:
        return {"lowercase": self.lowercase, "strip_punct": self.strip_punct,
                "bos_eos": self.bos_eos, "max_len": self.max_len}

    def tokenize(self, text: str) -> list[str]:
        return tokenize_caption(text, lowercase=self.lowercase, strip_punct=self.strip_punct)

    def encode(self, text: str | Iterable[str]) -> list[int]:
        """A caption (a string, tokenised with the stored settings, or a token list) → ids.

        Applies ``max_len`` and ``<start>``/``<end>`` as the store does; an empty caption gives ``[]``.
        """
        words = self.tokenize(text) if isinstance(text, str) else [str(w) for w in text]
        words = words[:truncate_length(len(words), bos_eos=self.bos_eos, max_len=self.max_len)]
        if not words:
            return []
        ids = [self.stoi.get(w, UNK) for w in words]
        return [START, *ids, END] if self.bos_eos else ids

    def decode(self, ids: Iterable[int], *, skip_specials: bool = True) -> str:
        """Ids → the space-joined words (``<start>``, ``<end>`` and ``<pad>`` dropped unless asked)."""
        words = []
        for i in map(int, ids):
            if not 0 <= i < len(self.itos):
                raise ValueError(f"token id {i} is outside this vocabulary of {len(self.itos)} words")
            if not (skip_specials and i in (PAD, START, END)):
                words.append(self.itos[i])
        return " ".join(words)

    # VSE++ / SCAN interop -------------------------------------------------------------------------
    def to_vsepp(self) -> dict[str, Any]:
        """The ``vocab.json`` form of VSE++ / SCAN: ``word2idx``, ``idx2word`` (string keys), ``idx``."""
        from ..storage.interop import vsepp_vocab_json

        return vsepp_vocab_json(self.itos)


def export_vocab_json(store: "FeatureStore | str | os.PathLike", path: str | os.PathLike) -> Path:
    """Write the store's vocabulary as a VSE++/SCAN ``vocab.json``; returns the path written."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise FileNotFoundError(f"cannot write {path}: folder {path.parent} does not exist")
    doc = Vocabulary.from_store(store).to_vsepp()
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=None), encoding="utf-8")
    return path
