""""Did you mean ...?": the closest valid names to a mistyped one (difflib), for every error that lists choices.

:func:`did_you_mean` builds the phrase; :func:`improve_message` rewrites any message of the form
``... 'NAME'; valid choices: a, b, c`` (or ``it has: a, b``) so it leads with the suggestion and, when
the list is long, names how many choices there are instead of printing all of them.
"""

from __future__ import annotations

import difflib
import re
from typing import Iterable

#: lists longer than this are shortened to their first names and a count when a suggestion is given
LONG_LIST = 12

# The built-in models' names, readable without torch, so ``vsekit train --model`` refuses a misspelt one
# before torch or any model is imported; the registries (``vsekit.models``, ``vsekit.extract.backbones``)
# hold exactly these (tests/test_one_message.py).
#: ``vsekit train --model``: the retrieval models of ``vsekit.models``
RETRIEVAL_MODELS = ("order", "saf", "seam-c", "seam-e", "seam-g", "sgr", "sman", "sman-im", "sman-im-loc",
                    "sman-inter", "sman-sim", "vse")

#: ``vsekit extract --model``: the registered backbones (any timm model name is taken too)
BACKBONES = ("inception_resnet_v2", "resnet152", "vgg16", "vgg19")


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    choices = [str(c) for c in choices]
    lower = {c.lower(): c for c in choices}
    found = difflib.get_close_matches(word.lower(), list(lower), n=n, cutoff=0.6)
    return [lower[f] for f in found]


def unknown_model(word: str, choices: Iterable[str], *, more: str = "", pool: Iterable[str] | None = None,
                  other: tuple[str, Iterable[str]] | None = None) -> str:
    """The one message of a ``--model`` that names nothing (train and extract alike): the closest names
    from ``pool`` (default ``choices``; extract passes timm's names too), then the valid choices.
    ``more`` ends the list (``"or any timm model name"``); ``other`` is (what they are, names) of another
    command's models, suggested when none of ``choices`` is close (train: extract's backbones)."""
    choices = list(choices)
    hint = did_you_mean(word, choices if pool is None else pool)
    if not hint and other is not None:
        found = close_matches(word, other[1], n=1)
        hint = f"did you mean {found[0]!r}, {other[0]}?" if found else ""
    listed = ", ".join(choices) + (f" {more}" if more else "")
    return f"--model {word!r}: unknown model; {hint + ' ' if hint else ''}(valid choices: {listed})"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"did you mean 'sh'?"`` (or ``'sh' or 'mh'``), or ``""`` when nothing is close."""
    found = close_matches(word, choices)
    if not found:
        return ""
    return "did you mean " + " or ".join(repr(f) for f in found) + "?"


_LISTED = re.compile(r"(?P<head>.*'(?P<word>[^']+)'[^';(]*?)(?P<sep>;\s*|\s*\()"
                     r"(?P<label>valid choices|valid|it has):\s*(?P<list>[^()\n;]*?)(?P<tail>\)?(?: \(.*\))?)$",
                     re.S)


def improve_message(message: str) -> str:
    """Insert a suggestion into a "... 'NAME'; valid choices: ..." message (unchanged when none fits)."""
    if "did you mean" in message:
        return message
    m = _LISTED.match(message)
    if not m:
        return message
    # "a, b or any timm model name": the last item's own words are not a choice
    choices = [c.split(" or ")[0].strip() for c in m.group("list").split(",") if c.strip()]
    hint = did_you_mean(m.group("word"), choices)
    if not hint:
        return message
    listed = m.group("list")
    if len(choices) > LONG_LIST:
        listed = f"{', '.join(choices[:LONG_LIST])}, ... ({len(choices)} in all)"
    return f"{m.group('head')}; {hint} ({m.group('label')}: {listed}){m.group('tail').lstrip(')')}"
