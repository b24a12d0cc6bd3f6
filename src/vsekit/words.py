"""Counted nouns in messages: ``1 row``, ``2 rows``, never ``1 rows``."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "stage")`` → ``"1 stage"``; ``plural(3, "stage")`` → ``"3 stages"``;
    ``many`` for irregular plurals (``plural(2, "entry", "entries")``)."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
