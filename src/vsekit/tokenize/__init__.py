"""Caption tokenisation: NLTK Treebank words, a vocabulary from the training captions only, and the
flat ``tokens/ids`` + ``tokens/offsets`` arrays of the store.

Follows VSE++ (Faghri et al., 2018) and SCAN (Lee et al., 2018): lower-cased
``NLTKWordTokenizer`` words, ``min_count`` 4, specials ``<pad>``/``<start>``/``<end>``/``<unk>``;
punctuation is kept by default, as in the FNE pipeline (Vilalta et al.). Unlike VSE++, test
captions never contribute to the vocabulary (see ``vocab.py``).
"""

from .runner import TokenizeSummary, caption_tokens, resolve_vocab_splits, tokenize  # noqa: F401
from .text import is_punct, normalize, tokenize_caption  # noqa: F401
from .vocab import (  # noqa: F401
    END, PAD, SPECIALS, START, UNK, Vocabulary, export_vocab_json, order_words,
)

__all__ = [
    "tokenize", "TokenizeSummary", "caption_tokens", "resolve_vocab_splits", "tokenize_caption",
    "normalize", "is_punct", "Vocabulary", "export_vocab_json", "order_words", "SPECIALS",
    "PAD", "START", "END", "UNK",
]
