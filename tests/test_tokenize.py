"""Tokenisation, vocabulary and the ragged token arrays (issue #5)."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from nltk.tokenize import NLTKWordTokenizer

from vsekit.cli import main
from vsekit.storage import FeatureStore, StoreError
from vsekit.tokenize import (
    SPECIALS, Vocabulary, caption_tokens, export_vocab_json, order_words, tokenize, tokenize_caption,
)
from vsekit.tokenize import runner


# tokenisation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("A man riding a wave on top of a surfboard.",
     ["a", "man", "riding", "a", "wave", "on", "top", "of", "a", "surfboard", "."]),
    ("Two dogs, one cat; and a bird!", ["two", "dogs", ",", "one", "cat", ";", "and", "a", "bird", "!"]),
    ("A man's hat isn't red", ["a", "man", "'s", "hat", "is", "n't", "red"]),
    ('He said "hi" (loudly)', ["he", "said", "``", "hi", "''", "(", "loudly", ")"]),
    ("a dog. a cat.", ["a", "dog", ".", "a", "cat", "."]),          # sentence-final periods split
    ("I cannot swim", ["i", "can", "not", "swim"]),                 # Treebank contraction
    ("3.5 pizzas cost $12", ["3.5", "pizzas", "cost", "$", "12"]),
    ("a man\u2019s \u201cbig\u201d hat", ["a", "man", "'s", "``", "big", "''", "hat"]),  # curly quotes
    ("  lots   of\t\twhite\nspace  ", ["lots", "of", "white", "space"]),
    ("zero\u200bwidth\u00a0nbsp", ["zerowidth", "nbsp"]),
    ("Caf\u0065\u0301 NA\u00cfVE \uff21\uff22", ["caf\u00e9", "na\u00efve", "ab"]),  # NFKC
    ("\u6771\u4eac\u306e\u72ac \U0001F600", ["\u6771\u4eac\u306e\u72ac", "\U0001F600"]),
    ("", []),
    ("   \t ", []),
])
def test_tokenize_caption_hand_written(text, expected):
    assert tokenize_caption(text) == expected


def test_strip_punct_and_keep_case():
    text = 'Wait... "A Dog", (a cat) -- a-b; yes!'
    assert tokenize_caption(text, strip_punct=True) == ["wait", "a", "dog", "a", "cat", "a-b", "yes"]
    assert tokenize_caption(text) == ["wait", "...", "``", "a", "dog", "''", ",", "(", "a", "cat", ")",
                                      "--", "a-b", ";", "yes", "!"]
    assert tokenize_caption("A Dog", lowercase=False) == ["A", "Dog"]
    assert tokenize_caption("?!.", strip_punct=True) == []


def _reference_tokens(text: str) -> list[str]:
    """NLTK itself on lower-cased, whitespace-collapsed text, split at '. ' (no fast path)."""
    text = " ".join(text.lower().split())
    return [t for piece in re.split(r"(?<=\.) ", text) for t in NLTKWordTokenizer().tokenize(piece)]


_WORDS = st.sampled_from(["a", "dog", "cannot", "gonna", "wanna", "3", "x1", "st", "u", "'s", "n't",
                          ",", ".", "...", "-", "--", "(", ")", '"', "'", "?", "tis", "man's", "a-b",
                          "dogs,", "dog's,", "3,5", "cannot-x", "t-", "-a", "1990's", "'t", "o'", "b's."])


@settings(max_examples=250, deadline=None)
@given(st.lists(_WORDS, max_size=12), st.sampled_from(["", ".", " .", "!"]), st.sampled_from([" ", "  "]))
def test_fast_path_matches_nltk(words, end, sep):
    text = sep.join(words) + end
    assert tokenize_caption(text) == _reference_tokens(text)


def test_very_long_caption():
    text = " ".join(["a big dog, and"] * 20000) + "."
    tokens = tokenize_caption(text)
    assert len(tokens) == 20000 * 5 + 1
    assert tokens[:5] == ["a", "big", "dog", ",", "and"] and tokens[-1] == "."


# vocabulary ---------------------------------------------------------------------------------------
def test_order_words_by_frequency_then_alphabet():
    counts = {"b": 5, "a": 5, "c": 9, "d": 3, "e": 4, "<unk>": 100}
    assert order_words(counts, 4) == ["c", "a", "b", "e"]
    assert order_words(counts, 1) == ["c", "a", "b", "e", "d"]
    with pytest.raises(ValueError, match="min-count"):
        order_words(counts, 0)


def test_vocabulary_encode_decode_and_vsepp_form(tmp_path):
    v = Vocabulary([*SPECIALS, "a", "dog"], max_len=4)
    assert len(v) == 6 and v.stoi["dog"] == 5 and v.itos[3] == "<unk>" and "dog" in v
    assert v.encode("A dog!") == [1, 4, 5, 2]      # max_len 4 counts <start>/<end>: 2 words kept
    assert v.encode("a cat dog") == [1, 4, 3, 2]
    assert v.encode("") == []
    assert v.decode([1, 4, 3, 5, 2, 0]) == "a <unk> dog"
    assert v.decode([1, 4, 2], skip_specials=False) == "<start> a <end>"
    with pytest.raises(ValueError, match="outside"):
        v.decode([6])
    with pytest.raises(ValueError, match="specials"):
        Vocabulary(["a", "<pad>"])
    assert v.to_vsepp() == {"word2idx": {"<pad>": 0, "<start>": 1, "<end>": 2, "<unk>": 3, "a": 4, "dog": 5},
                            "idx2word": {"0": "<pad>", "1": "<start>", "2": "<end>", "3": "<unk>",
                                         "4": "a", "5": "dog"},
                            "idx": 6}


# the store ----------------------------------------------------------------------------------------
TRAIN = [
    "A red dog runs.", "the red dog sleeps", "A red cat runs", "red dog, red cat", "The dog runs!",
    "a cat sleeps", "", "a cat, a dog.", "   ", "Émile’s café is red",
]
VAL = ["a red bird", "a cat runs", "the bird sleeps", "the bird runs"]
TEST = ["a zebra runs", "a zebra sleeps", "the zebra", "zebra zebra zebra", "a red zebra"]
RESTVAL = ["the bird flies", "a bird flies", "a kite flies", "a kite flies high"]


@pytest.fixture()
def hand_store(tmp_path):
    """Five images (train, train, val, test, restval) with hand-written captions."""
    store = FeatureStore.create(tmp_path / "hand.zarr", dataset="hand")
    store.write_images(["i0", "i1", "i2", "i3", "i4"], ["0.jpg", "1.jpg", "2.jpg", "3.jpg", "4.jpg"],
                       ["train", "train", "val", "test", "restval"])
    texts = TRAIN + VAL + TEST + RESTVAL
    owners = [0] * 5 + [1] * 5 + [2] * len(VAL) + [3] * len(TEST) + [4] * len(RESTVAL)
    store.write_captions(texts, owners)
    return store


def _reference_vocab(captions: list[str], min_count: int) -> list[str]:
    counts = Counter(w for c in captions for w in tokenize_caption(c))
    return [*SPECIALS, *sorted((w for w in counts if counts[w] >= min_count), key=lambda w: (-counts[w], w))]


def _stored(store: FeatureStore) -> tuple[np.ndarray, np.ndarray, dict]:
    g = FeatureStore.open(store.path).root["tokens"]
    return g["ids"][:], g["offsets"][:], dict(g.attrs)


def test_vocabulary_from_train_val_restval_never_test(hand_store):
    summary = tokenize(hand_store, min_count=2)
    ids, offsets, attrs = _stored(hand_store)
    expected = _reference_vocab(TRAIN + VAL + RESTVAL, 2)
    assert attrs["vocabulary"] == expected
    # counted by hand: a 10, red 7, bird/cat/dog/runs/the 5, flies 4, sleeps 3, ",", ".", kite 2
    assert expected[4:] == ["a", "red", "bird", "cat", "dog", "runs", "the", "flies", "sleeps", ",", ".", "kite"]
    assert "zebra" not in attrs["vocabulary"]                      # test-only word
    assert "kite" in attrs["vocabulary"]                           # restval counts with train
    assert attrs["vocab_splits"] == ["train", "val", "restval"] and attrs["min_count"] == 2
    assert attrs["specials"] == list(SPECIALS)
    v = Vocabulary.from_store(hand_store.path)
    zebra_caption = len(TRAIN + VAL) + 3                           # "zebra zebra zebra"
    assert ids[offsets[zebra_caption]:offsets[zebra_caption + 1]].tolist() == [1, 3, 3, 3, 2]
    # "!", "émile", "'s", "café", "is" (train, once each), 7 zebras (test), "high" (restval)
    assert summary.unknown == attrs["n_unknown"] == 5 + 7 + 1
    assert summary.vocab_captions == len(TRAIN) + len(VAL) + len(RESTVAL)
    assert len(v) == summary.vocabulary == len(expected)


def test_min_count_default_four(hand_store):
    tokenize(hand_store)
    vocab = _stored(hand_store)[2]["vocabulary"]
    assert vocab == [*SPECIALS, "a", "red", "bird", "cat", "dog", "runs", "the", "flies"]  # sleeps: 3
    assert vocab == _reference_vocab(TRAIN + VAL + RESTVAL, 4)


def test_offsets_ids_round_trip_every_caption(hand_store):
    tokenize(hand_store, min_count=1, vocab_splits="train")
    ids, offsets, attrs = _stored(hand_store)
    texts = TRAIN + VAL + TEST + RESTVAL
    itos = attrs["vocabulary"]
    stoi = {w: i for i, w in enumerate(itos)}
    assert offsets[0] == 0 and offsets[-1] == len(ids) and len(offsets) == len(texts) + 1
    for m, text in enumerate(texts):
        words = tokenize_caption(text)
        want = [1, *[stoi.get(w, 3) for w in words], 2] if words else []
        assert ids[offsets[m]:offsets[m + 1]].tolist() == want, text
        assert [itos[i] if i != 3 else w for i, w in zip(want[1:-1], words)] == words
    assert caption_tokens(hand_store, [0])[0].tolist() == [1, stoi["a"], stoi["red"], stoi["dog"], stoi["runs"],
                                                           stoi["."], 2]


def test_empty_and_unicode_captions(hand_store):
    summary = tokenize(hand_store, min_count=1)
    ids, offsets, attrs = _stored(hand_store)
    assert summary.empty == attrs["n_empty"] == 2                  # "" and "   "
    assert offsets[6] == offsets[7] and offsets[8] == offsets[9]
    v = Vocabulary.from_store(hand_store)
    assert v.decode(ids[offsets[9]:offsets[10]]) == "émile 's café is red"
    assert tokenize(hand_store, min_count=1, strip_punct=True).empty == 2
    assert "." not in _stored(hand_store)[2]["vocabulary"]


def test_max_len_and_no_bos_eos(hand_store):
    summary = tokenize(hand_store, min_count=1, max_len=4)
    ids, offsets, attrs = _stored(hand_store)
    lengths = np.diff(offsets)
    full = [len(tokenize_caption(t)) for t in TRAIN + VAL + TEST + RESTVAL]
    assert lengths.tolist() == [min(n, 2) + 2 if n else 0 for n in full]
    assert summary.truncated == attrs["n_truncated"] == sum(n > 2 for n in full)
    assert attrs["max_len"] == 4 and attrs["bos_eos"] is True
    assert ids[offsets[1] - 1] == 2 and ids[offsets[0]] == 1       # <end> kept after truncation

    tokenize(hand_store, min_count=1, bos_eos=False, max_len=3)
    ids, offsets, attrs = _stored(hand_store)
    assert np.diff(offsets).tolist() == [min(n, 3) for n in full]
    assert not np.isin(ids, [0, 1, 2]).any() and attrs["bos_eos"] is False
    with pytest.raises(ValueError, match="max-len"):
        tokenize(hand_store, max_len=2)


def _tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_rerun_identical_and_chunking_invariant(hand_store, monkeypatch):
    tokens_dir = hand_store.path / "tokens"
    tokenize(hand_store, min_count=1, chunk_tokens=8)
    first = _tree_digest(tokens_dir)
    assert len([k for k in first if k.startswith("ids/c")]) > 5    # many aligned chunks
    tokenize(hand_store, min_count=1, chunk_tokens=8)
    assert _tree_digest(tokens_dir) == first
    tokenize(hand_store, min_count=1, chunk_tokens=8, chunk_captions=3)   # 10 count tasks
    assert _tree_digest(tokens_dir) == first
    assert not (hand_store.path / runner.STAGING).exists()

    def boom(task):
        raise RuntimeError("worker died")
    monkeypatch.setattr(runner, "count_chunk", boom)
    with pytest.raises(RuntimeError):
        tokenize(hand_store, min_count=3)
    assert _tree_digest(tokens_dir) == first                       # old tokens untouched


def test_parallel_processes_same_bytes(hand_store):
    tokenize(hand_store, min_count=1, chunk_captions=4)
    single = _tree_digest(hand_store.path / "tokens")
    tokenize(hand_store, min_count=1, chunk_captions=4, workers=2)
    assert _tree_digest(hand_store.path / "tokens") == single


def test_vocab_splits_validation(hand_store):
    with pytest.raises(ValueError, match="test"):
        tokenize(hand_store, vocab_splits="train,test")
    with pytest.raises(ValueError, match="valid choices"):
        tokenize(hand_store, vocab_splits="train,dev")
    summary = tokenize(hand_store, vocab_splits="val", min_count=1)
    assert summary.vocab_splits == ["val"] and summary.vocab_captions == len(VAL)
    assert _stored(hand_store)[2]["vocabulary"] == _reference_vocab(VAL, 1)


def test_export_vocab_json(hand_store, tmp_path):
    tokenize(hand_store, min_count=2)
    out = export_vocab_json(hand_store, tmp_path / "vocab.json")
    doc = json.loads(out.read_text())
    itos = _reference_vocab(TRAIN + VAL + RESTVAL, 2)
    assert doc["idx"] == len(itos)
    assert doc["word2idx"] == {w: i for i, w in enumerate(itos)}
    assert doc["idx2word"] == {str(i): w for i, w in enumerate(itos)}


def test_no_tokens_or_captions_errors(tmp_path):
    store = FeatureStore.create(tmp_path / "empty.zarr", dataset="x")
    with pytest.raises(StoreError, match="has no tokens; run `vsekit tokenize --store"):
        Vocabulary.from_store(store)
    with pytest.raises(StoreError, match="no captions"):
        tokenize(store)


# the CLI ------------------------------------------------------------------------------------------
def test_cli_tokenize_demo(demo_store):
    res = CliRunner().invoke(main, ["tokenize", "--store", str(demo_store.path), "--max-len", "12"])
    assert res.exit_code == 0, res.output
    assert f"tokenized {demo_store.n_captions} captions" in res.output
    ids, offsets, attrs = _stored(demo_store)
    assert attrs["max_len"] == 12 and np.diff(offsets).max() == 12
    v = Vocabulary.from_store(demo_store)
    first = str(demo_store.caption_text(0, 1)[0])
    assert ids[offsets[0]:offsets[1]].tolist() == v.encode(first) and len(v.encode(first)) == 12

    res = CliRunner().invoke(main, ["tokenize", "--store", str(demo_store.path), "--vocab-splits", "train,test"])
    assert res.exit_code == 1 and "Error:" in res.output and "test" in res.output
    res = CliRunner().invoke(main, ["tokenize", "--store", str(demo_store.path), "--max-len", "2"])
    assert res.exit_code == 1 and "Error: --max-len must be at least 3" in res.output
    res = CliRunner().invoke(main, ["tokenize", "--store", str(demo_store.path), "--no-bos-eos", "--strip-punct",
                                    "--min-count", "1"])
    assert res.exit_code == 0, res.output
    ids, offsets, attrs = _stored(demo_store)
    assert attrs["strip_punct"] is True and attrs["bos_eos"] is False and attrs["min_count"] == 1
    assert not np.isin(ids, [1, 2]).any() and "," not in attrs["vocabulary"]


def test_cli_cluster_local_same_bytes(demo_store):
    tokenize(demo_store)
    single = _tree_digest(demo_store.path / "tokens")
    res = CliRunner().invoke(main, ["tokenize", "--store", str(demo_store.path), "--cluster", "local:1",
                                    "--chunk-captions", "32"])     # several count tasks on the cluster
    assert res.exit_code == 0, res.output
    assert _tree_digest(demo_store.path / "tokens") == single


def test_package_imports_without_click_or_dask():
    code = ("import sys, vsekit.tokenize; "
            "bad = [m for m in ('click', 'distributed', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
