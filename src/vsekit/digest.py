"""Content digests of input files, so a provenance record names the bytes used, not only a path.

A path alone cannot tell a rerun that someone replaced ``weights.pth`` with another file of the same
name; the SHA-256 of its content can.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK = 1 << 20  # read 1 MiB at a time: memory stays bounded whatever the file's size


def file_digest(path: str | Path) -> str:
    """``"sha256:<hex>"`` of the file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()
