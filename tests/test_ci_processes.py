"""`make test-slow SLOW_WORKERS=3` runs the slow set in several pytest-xdist processes (``-n 3 --dist loadfile``,
tests/conftest.py): a module's tests in one process, and every module that uses the machine's one
Grid Engine cell in one process together (a module's teardown deletes every job in the cell and
stops its daemons, tests/sge_local.py). Here the grouping is checked against the modules' syntax
trees: a module that imports tests/sge_local.py or asks for a Grid Engine fixture."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import conftest

TESTS = Path(__file__).resolve().parent
GRID_ENGINE_FIXTURES = {"local_sge", "sge", "on_sge"}   # conftest's, and tests/test_sge.py's own


def asks_for_grid_engine(path: Path) -> bool:
    """An import of ``sge_local`` or a function taking a Grid Engine fixture, read from the syntax tree."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "sge_local" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "sge_local":
            return True
        if isinstance(node, ast.FunctionDef) and GRID_ENGINE_FIXTURES & {a.arg for a in node.args.args}:
            return True
    return False


def test_the_grid_engine_modules_are_found_by_what_they_use():
    modules = sorted(TESTS.glob("test_*.py"))
    found = {p.name for p in modules if conftest.uses_grid_engine(p)}
    asks = {p.name for p in modules if asks_for_grid_engine(p)}
    assert asks <= found, f"on the Grid Engine but not grouped: {sorted(asks - found)}"
    # the text check may take a module that only names them (this one): one more module in that process
    assert found - asks <= {Path(__file__).name}, sorted(found - asks)
    assert {"test_sge.py", "test_objstore_array.py"} <= found and "test_slurm.py" not in found


def test_loadfile_keeps_a_module_together_and_every_grid_engine_module_in_one_scope():
    pytest.importorskip("xdist")
    options = {"dist": "loadfile", "tx": ["3*popen"]}
    config = types.SimpleNamespace(getvalue=options.get, rootpath=TESTS.parent)
    sched = conftest.pytest_xdist_make_scheduler(config, None)
    scope = sched._split_scope
    assert scope("tests/test_sge.py::test_a") == scope("tests/test_objstore_array.py::test_b[x]") == "gridengine"
    assert scope("tests/test_slurm.py::test_a") == scope("tests/test_slurm.py::test_b") == "tests/test_slurm.py"
    assert scope("tests/test_slurm_array.py::test_a") == "tests/test_slurm_array.py"
    config.getvalue = {"dist": "load", "tx": ["3*popen"]}.get
    assert conftest.pytest_xdist_make_scheduler(config, None) is None   # other modes: xdist's own
