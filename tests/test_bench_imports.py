"""The bench scripts import each other's helpers by bare module name (``from procs import
make_photos``), often inside a function, so a rename in one bench file breaks another only when
that code path runs: CI went red once on exactly this (gpu_check's throughput check imported
``make_photos`` from ``bench/decode.py`` after it had moved to ``bench/procs.py``). Every such
import, at any depth, in bench/ and scripts/ must name a module in bench/ that defines the name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _defined(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _sibling_imports(path: Path):
    """(line, module, names) for ``from M import names`` and for each ``M.name`` after ``import M``."""
    tree = ast.parse(path.read_text())
    bare = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and (BENCH / f"{node.module}.py").exists():
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            bare.update(a.asname or a.name for a in node.names if (BENCH / f"{a.name}.py").exists())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bare:
            yield node.lineno, node.value.id, [node.attr]


def test_every_bench_helper_imported_by_bare_name_exists_where_it_is_imported_from():
    files = sorted(BENCH.glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    seen, missing = 0, []
    for f in files:
        for line, module, names in _sibling_imports(f):
            have = _defined(BENCH / f"{module}.py")
            for n in names:
                seen += 1
                if n != "*" and n not in have:
                    missing.append(f"{f.relative_to(ROOT)}:{line}: {n} is not in bench/{module}.py")
    assert seen >= 5, seen        # the walk found the imports it exists for
    assert not missing, "\n".join(missing)


def test_the_check_catches_a_name_that_moved(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("def here():\n    pass\n")
    (tmp_path / "b.py").write_text("import a\n\ndef f():\n    from a import gone\n    a.here(); a.moved()\n")
    monkeypatch.setitem(globals(), "BENCH", tmp_path)
    found = list(_sibling_imports(tmp_path / "b.py"))
    assert found == [(4, "a", ["gone"]), (5, "a", ["here"]), (5, "a", ["moved"])]
    assert "gone" not in _defined(tmp_path / "a.py") and "here" in _defined(tmp_path / "a.py")
