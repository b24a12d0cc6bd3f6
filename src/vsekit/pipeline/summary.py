"""One table of every evaluated run's metrics, printed at the end of a pipeline.

``metrics.json`` is read as written by ``vsekit evaluate``; nested protocols and directions are
flattened to columns (``coco-1k i2t R@1``...), and only the columns the runs share in the papers'
order are shown, so the table stays readable whatever the evaluation recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

_ORDER = ("r1", "r@1", "r5", "r@5", "r10", "r@10", "medr", "med_r", "meanr", "mean_r", "mrr", "rsum")


def _flatten(d: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix} {k}".strip()))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix] = float(d)
    return out


def _rank(col: str) -> tuple:
    last = col.split()[-1].lower()
    return (last == "rsum", col.split()[:-1], _ORDER.index(last) if last in _ORDER else len(_ORDER), col)


def _papers_table(docs: list[tuple[str, Any]]) -> str | None:
    """The trainer's own table (papers' layout) when every file is a ``vsekit evaluate`` result."""
    if not docs or not all(isinstance(d, dict) and isinstance(d.get("protocols"), dict) for _, d in docs):
        return None
    from ..train.evaluation import format_table

    try:
        return format_table([(label, p, m) for label, d in docs for p, m in d["protocols"].items()])
    except (KeyError, TypeError, ValueError):
        return None


def metrics_table(runs: Iterable[tuple[str, Path]], max_columns: int = 16) -> str:
    """A fixed-width table: one row per run label (and protocol), one column per shared metric."""
    docs: list[tuple[str, Any]] = []
    for label, path in runs:
        try:
            docs.append((label, json.loads(Path(path).read_text())))
        except (OSError, ValueError):
            docs.append((label, None))
    papers = _papers_table(docs)
    if papers:
        return papers
    rows = [(label, _flatten(doc) if doc is not None else {}) for label, doc in docs]
    present = [r for _, r in rows if r]
    if not present:
        return ""
    cols = set(present[0])
    for r in present[1:]:
        cols &= set(r)
    if not cols:  # nothing shared: take the union
        cols = set().union(*present)
    wanted = [c for c in cols if c.split()[-1].lower() in _ORDER]
    cols = sorted(wanted or cols, key=_rank)[:max_columns]
    width = max(len(label) for label, _ in rows)
    head = f"{'run':<{width}}  " + "  ".join(f"{c:>{max(7, len(c))}}" for c in cols)
    lines = [head, "-" * len(head)]
    for label, r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{'-' if v is None else f'{v:.2f}':>{max(7, len(c))}}")
        lines.append(f"{label:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
