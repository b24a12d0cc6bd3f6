"""Caption text → word tokens, with NLTK's Treebank-style word tokenizer.

VSE++ (Faghri et al., 2018, ``vocab.py``) and SCAN tokenise captions with
``nltk.tokenize.word_tokenize(caption.lower())``; the FNE pipeline (Vilalta et al.) keeps the
punctuation tokens. ``word_tokenize`` first splits sentences with the Punkt model, which needs an
``nltk.download``; vsekit never downloads, so it uses ``NLTKWordTokenizer`` (the tokenizer
``word_tokenize`` calls) directly and approximates the sentence split with one rule: a period
followed by whitespace ends a sentence. Without it the Treebank rules keep a mid-caption period on
its word ("dog." in "a dog. a cat."). Unlike Punkt, the rule does not know abbreviations, so
"mr. smith" gives "mr", ".", "smith".

Before tokenising, text is normalised so that visually equal captions give equal tokens: NFKC
(full-width letters, ligatures, non-breaking spaces), curly quotes to ASCII quotes (so "man’s"
splits like "man's"), control characters to spaces, zero-width characters removed, and runs of
whitespace collapsed to one space (some Treebank rules look for a literal space).
"""

from __future__ import annotations

import re
import string
import unicodedata

from nltk.tokenize import NLTKWordTokenizer

_TREEBANK = NLTKWordTokenizer()

_QUOTES = str.maketrans({
    "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"',
    "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
})
_SENTENCE_END = re.compile(r"(?<=\.) ")
# The common case: lower-case ASCII words (hyphens inside, optionally ending in "'s" and/or a
# comma) separated by single spaces, with at most a final period. For these the Treebank rules
# reduce to splitting off "'s", "," and the final "." (checked against NLTK itself in
# tests/test_tokenize.py), except the MacIntyre contractions below, which go the slow way.
_WORD = r"[a-z0-9]+(?:-[a-z0-9]+)*(?:'s)?"
_PLAIN = re.compile(rf"(?:{_WORD},? )*{_WORD}")
_CONTRACTION_WORDS = re.compile(r"\b(?:cannot|gimme|gonna|gotta|lemme|wanna)\b")
_ASCII_PUNCT = frozenset(string.punctuation)


def normalize(text: str) -> str:
    """NFKC, ASCII quotes, no control or zero-width characters, single spaces, stripped."""
    text = str(text)
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text).translate(_QUOTES)
    if not text.isascii() or not text.isprintable():
        text = "".join(_clean_char(c) for c in text)
    return " ".join(text.split())


def _clean_char(c: str) -> str:
    cat = unicodedata.category(c)
    if cat == "Cf":  # zero-width space/joiners, BOM, bidi marks
        return ""
    if cat in ("Cc", "Zl", "Zp"):
        return " "
    return c


def _split_plain(body: str) -> list[str]:
    # in a _PLAIN match "'s" and "," only ever end a word
    if "," in body or "'" in body:
        body = body.replace("'s", " 's").replace(",", " ,")
    return body.split(" ")


def is_punct(token: str) -> bool:
    """A token made only of punctuation (Unicode P* categories or ASCII punctuation like ``$ `` ``)."""
    return bool(token) and all(c in _ASCII_PUNCT or unicodedata.category(c).startswith("P") for c in token)


def tokenize_caption(text: str, *, lowercase: bool = True, strip_punct: bool = False) -> list[str]:
    """The word tokens of one caption; an empty or blank caption gives ``[]``."""
    text = normalize(text)
    if lowercase:
        text = text.lower()
    if not text:
        return []
    body = text[:-1] if text.endswith(".") else text
    if _PLAIN.fullmatch(body) and not _CONTRACTION_WORDS.search(body):
        tokens = _split_plain(body)
        if body is not text:
            tokens.append(".")
    else:
        tokens = [tok for piece in _SENTENCE_END.split(text) for tok in _TREEBANK.tokenize(piece)]
    if strip_punct:
        tokens = [tok for tok in tokens if not is_punct(tok)]
    return tokens
