"""What every ingester shares: reading JSON with positions in errors, and the skip report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import StoreError


class IngestError(StoreError):
    """Input that cannot be ingested; the message names the file and the line or row."""


@dataclass
class IngestReport:
    """What an ingest did and what it skipped. With ``strict`` a skip is an error instead."""

    strict: bool = False
    skipped: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def skip(self, message: str) -> None:
        if self.strict:
            raise IngestError(f"{message} (--strict turns skips into errors)")
        self.skipped.append(message)

    def summary(self) -> str:
        parts = [f"{v} {k}" for k, v in self.counts.items()]
        text = "ingested " + ", ".join(parts) if parts else "ingested nothing"
        if self.skipped:
            shown = "\n  ".join(self.skipped[:20])
            more = f"\n  ... and {len(self.skipped) - 20} more" if len(self.skipped) > 20 else ""
            text += f"\nskipped {len(self.skipped)}:\n  {shown}{more}"
        return text


def read_json(path: str | Path) -> Any:
    path = Path(path)
    if not path.exists():
        raise IngestError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise IngestError(f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise IngestError(f"{path}: not UTF-8 text (byte {exc.start})") from None
