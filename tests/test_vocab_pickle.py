"""The VSE++ vocabulary pickle is byte for byte what Python 3's ``pickle.dumps(vocab, protocol=2)``
gives for VSE++'s own ``vocab.Vocabulary`` built from the same words (their class re-implemented
here, registered as module ``vocab``, pickled by the C pickler)."""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
import types

import pytest

from vsekit.storage.interop import vsepp_vocab_pickle


class Vocabulary(object):
    """VSE++'s vocab.py class, as they define and fill it."""

    def __init__(self):
        self.word2idx = {}
        self.idx2word = {}
        self.idx = 0

    def add_word(self, word):
        if word not in self.word2idx:
            self.word2idx[word] = self.idx
            self.idx2word[self.idx] = word
            self.idx += 1


@pytest.fixture
def vocab_module(monkeypatch):
    module = types.ModuleType("vocab")
    Vocabulary.__module__ = "vocab"
    module.Vocabulary = Vocabulary
    monkeypatch.setitem(sys.modules, "vocab", module)
    return module


def _theirs(itos):
    v = Vocabulary()
    for w in itos:
        v.add_word(w)
    return pickle.dumps(v, protocol=2)


@pytest.mark.parametrize("n_words", [3, 300, 1500])  # one-byte and 4-byte memo indices; SETITEMS batches
def test_vocab_pickle_is_their_pickle_byte_for_byte(vocab_module, n_words):
    itos = ["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(n_words)] + ["café", "über"]
    ours = vsepp_vocab_pickle(itos)
    theirs = _theirs(itos)
    assert len(ours) == len(theirs)
    assert ours == theirs
    assert ours[:2] == b"\x80\x02"  # protocol 2, as VSE++'s Python 2 HIGHEST_PROTOCOL
    pickletools.dis(ours, out=io.StringIO())  # a well-formed opcode stream
    back = pickle.loads(ours)
    assert type(back) is Vocabulary
    assert back.word2idx == {w: i for i, w in enumerate(itos)} and back.idx2word == dict(enumerate(itos))
    assert back.idx == len(itos) and list(vars(back)) == ["word2idx", "idx2word", "idx"]
