"""docs/architecture.md names only things that exist: every repository path it names is on disk, and
every test it cites (``tests/test_x.py::test_y``) is a test function of that file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
# a repository path: src/..., tests/..., docs/..., bench/... (a "<placeholder>" in it makes it a pattern)
PATH = re.compile(r"\b((?:src|tests|docs|bench)/[\w./<>-]*)(?:::(\w+))?")


def named(text: str) -> list[tuple[str, str | None]]:
    out = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if "<" in path or ">" in path:
            continue   # a pattern such as tests/test_formats_<format>.py
        out.append((path, m.group(2)))
    return out


def test_finder_reads_paths_tests_and_skips_patterns():
    text = ("see `src/vsekit/train/data.py`, `tests/test_x.py::test_y`, src/vsekit/cli/ and "
            "`tests/test_formats_<format>.py`.")
    assert named(text) == [("src/vsekit/train/data.py", None), ("tests/test_x.py", "test_y"),
                           ("src/vsekit/cli/", None)]


def test_every_path_and_test_named_in_the_architecture_page_exists():
    found = named(DOC.read_text())
    assert len(found) > 20   # the page names its modules
    missing = [p for p, _ in found if not (REPO / p).exists()]
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"
    absent = []
    for path, test in found:
        if test is None:
            continue
        tree = ast.parse((REPO / path).read_text())
        if test not in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}:
            absent.append(f"{path}::{test}")
    assert absent == [], f"docs/architecture.md cites tests that do not exist: {absent}"


def test_the_page_has_its_sections():
    heads = [line for line in DOC.read_text().splitlines() if line.startswith("## ")]
    for head in ("## Layers", "## Extraction", "## From the store to the loss: one training batch",
                 "## Where each concept lives", "## Where a new thing goes"):
        assert head in heads
