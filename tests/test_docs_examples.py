"""Every example in README.md and docs/ runs (issue 45): each fenced ``bash``/``sh``/``console``/
``python`` block is executed, in the order of its page, in one temporary folder per page, and its
output is compared where the page shows one. A block that cannot run here says why, in an HTML
comment on the line before it, and the reason is printed as the test's skip reason:

    <!-- not run: needs a SLURM cluster -->      never run here; the reason is printed
    <!-- slow -->                                 run by the slow tests (and so is the rest of its page)
    <!-- output -->                               before a ```text block: the previous block's output
    <!-- docs-test: demo-store -->                (anywhere on a page) its folder starts with demo.zarr

A ``console`` block is ``$ command`` lines, each followed by the output it prints (an ``Error:`` line
there: the command must exit with code 1); in a shown output
(there or in an ``<!-- output -->`` block) a line ``...`` stands for any lines and ``...`` inside a
line for any text. A fence with no language fails: every block says what it is (``text`` when it is
not code), so no example can hide from this test.

Why not a plugin (pytest-codeblocks, pytest-markdown-docs, phmdoctest, mktestdocs, Sybil): none runs
the shell blocks of a page in order in one scratch folder with per-block skip reasons and the
project's ``slow`` marker; this is the ~150 lines that do, over the same fence syntax they read.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
RUN = {"bash", "sh", "shell", "console", "python"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
MARK = re.compile(r"^\s*<!--\s*(?P<kind>not run|slow|output)\s*:?\s*(?P<reason>.*?)\s*-->\s*$")

pytestmark = pytest.mark.e2e


@dataclass
class Block:
    page: Path
    line: int          # 1-based line of the opening fence
    lang: str
    code: str
    mark: str = ""     # "", "not run", "slow" or "output"
    reason: str = ""
    slow: bool = False

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page, with the marker on the line before each."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        close = re.compile(rf"^\s*{m['fence'][0]}{{{len(m['fence'])},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(prev)
        out.append(Block(page, i + 1, m["lang"].lower(), textwrap.dedent("\n".join(lines[i + 1:j])),
                         mark["kind"] if mark else "", mark["reason"] if mark else ""))
        i = j + 1
    slow = False
    for b in out:   # a slow block makes the rest of its page slow: later blocks may need what it made
        slow = b.slow = slow or b.mark == "slow"
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUNNABLE = [b for b in ALL if b.lang in RUN]


def test_every_fence_says_what_it_is():
    untagged = [b.id for b in ALL if not b.lang]
    assert not untagged, f"fences with no language (```text when it is not code): {untagged}"
    stray = [b.id for b in ALL if b.mark == "output" and b.lang != "text"]
    assert not stray, f"<!-- output --> goes before a ```text block: {stray}"


def _expected(shown: str) -> re.Pattern:
    parts = []
    for line in shown.strip("\n").splitlines():
        line = line.rstrip()
        parts.append(r"(?:.*\n)*?" if line == "..." else ".*".join(re.escape(p) for p in line.split("...")) + r"\n")
    return re.compile("".join(parts))


def _check(got: str, shown: str, where: str) -> None:
    text = "\n".join(line.rstrip() for line in got.strip("\n").splitlines()) + "\n"
    assert _expected(shown).fullmatch(text), f"{where}: output differs from the page's\n--- page:\n{shown}\n--- got:\n{text}"


def _shell(command: str, cwd: Path, rc: int = 0) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "COLUMNS": "100", "NO_COLOR": "1"}
    res = subprocess.run(["bash", "-c", "set -eo pipefail\n" + command], cwd=cwd, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    assert res.returncode == rc, f"exit code {res.returncode}, not {rc}, from:\n{command}\n--- output:\n{res.stdout}"
    return res.stdout


def _console(code: str, cwd: Path, where: str) -> None:
    """``$ cmd`` lines (a trailing ``\\`` continues one) and the output each must print."""
    steps: list[list[str]] = []
    for line in code.splitlines():
        if line.startswith("$ ") or (steps and steps[-1][0].endswith("\\") and len(steps[-1]) == 1):
            if steps and len(steps[-1]) == 1 and steps[-1][0].endswith("\\"):
                steps[-1][0] = steps[-1][0][:-1] + " " + line.strip()
            else:
                steps.append([line[2:]])
        elif steps:
            steps[-1].append(line)
    for command, *shown in steps:
        refused = any(s.startswith("Error: ") for s in shown)   # a refusal shown: exit code 1, that line
        got = _shell(command, cwd, rc=1 if refused else 0)
        if any(s.strip() for s in shown):
            _check(got, "\n".join(shown), f"{where} `{command}`")


def _run(block: Block, cwd: Path, shown: str | None) -> None:
    if block.lang == "console":
        return _console(block.code, cwd, block.id)
    command = block.code if block.lang != "python" else f"{sys.executable} - <<'VSEKIT_DOCS_EOF'\n{block.code}\nVSEKIT_DOCS_EOF"
    got = _shell(command, cwd)
    if shown is not None:
        _check(got, shown, block.id)


def _demo_store(root: Path) -> Path:
    """The small store of `<!-- docs-test: demo-store -->` pages, made once: 160 demo images (40 val,
    20 test) ingested, tokenized and with VGG-19 global features at 32x32 (random weights)."""
    if (root / "demo.zarr").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    _shell("vsekit demo-data data --images 160 --size 32 --val 40 --test 20 > /dev/null\n"
           "vsekit ingest karpathy data/dataset_demo.json --store demo.zarr > /dev/null\n"
           "vsekit tokenize --store demo.zarr --min-count 1 > /dev/null\n"
           "vsekit extract --store demo.zarr --model vgg19 --kind global --weights none --resize 32 --input-size 32 "
           "--no-progress > /dev/null", root)
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per page: its scratch folder and how far its blocks have run."""
    return {"root": tmp_path_factory.mktemp("docs"), "pages": {}}


def _page_state(folders, page: Path) -> dict:
    pages = folders["pages"]
    if page not in pages:
        cwd = folders["root"] / str(page.relative_to(REPO)).replace("/", "_")
        cwd.mkdir()
        if "<!-- docs-test: demo-store -->" in page.read_text():
            store = _demo_store(folders["root"] / "_demo-store")
            shutil.copytree(store / "demo.zarr", cwd / "demo.zarr")
            shutil.copytree(store / "data", cwd / "data")
        pages[page] = {"cwd": cwd, "done": set(), "failed": None}
    return pages[page]


def _params():
    for b in RUNNABLE:
        marks = [pytest.mark.slow] if b.slow else []
        yield pytest.param(b, id=b.id, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_example_runs(block: Block, folders):
    if block.mark == "not run":
        assert block.reason, f"{block.id}: `<!-- not run: ... -->` must say why"
        pytest.skip(f"{block.id}: not run: {block.reason}")
    page_blocks = blocks(block.page)
    state = _page_state(folders, block.page)
    for k, b in enumerate(page_blocks):   # this block, after every earlier block of its page that runs
        if b.lang not in RUN or b.mark == "not run" or (b.slow and not block.slow) or b.line in state["done"]:
            if b.line == block.line:
                break
            continue
        if state["failed"]:
            pytest.fail(f"an earlier block of the page failed: {state['failed']}")
        nxt = page_blocks[k + 1] if k + 1 < len(page_blocks) else None
        shown = nxt.code if nxt is not None and nxt.mark == "output" else None
        try:
            _run(b, state["cwd"], shown)
        except BaseException:
            state["failed"] = b.id
            raise
        state["done"].add(b.line)
        if b.line == block.line:
            break
