"""The package's modules import each other without circles.

A circle (a imports b, b imports a, even lazily inside a function) means neither module can be read
or tested alone, and lazy imports that hide it break as soon as someone moves one to the top. The
graph is built from the source with ``ast`` (every ``import`` / ``from ... import`` statement that
runs, function-level ones included; ``if TYPE_CHECKING:`` blocks are left out since they never run).
Modules loaded by name at run time count too: ``importlib.import_module(X)`` and ``__import__(X)``
with ``X`` a string, an f-string of ``__name__`` / ``__package__``, or a loop variable over a literal
tuple (or a module-level tuple of strings). A call whose target cannot be read from the source is
reported by ``test_every_dynamic_import_is_visible``: the graph would not see its edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vsekit

ROOT = Path(vsekit.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _literal_strings(node: ast.AST | None) -> list[str] | None:
    """The strings of a literal tuple/list of strings, else None."""
    if isinstance(node, (ast.Tuple, ast.List)) and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]
    return None


def _is_dynamic_import(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))


def _dynamic_targets(arg: ast.AST, name: str, package: str, names: dict[str, list[str]]) -> list[str] | None:
    """The module names a dynamic import's argument can take; None when the source does not say."""
    specials = {"__name__": [name], "__package__": [package]}
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.Name):
        return specials.get(arg.id) or names.get(arg.id)
    if isinstance(arg, ast.JoinedStr):
        out = [""]
        for part in arg.values:
            if isinstance(part, ast.Constant):
                options = [str(part.value)]
            elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and (
                    part.value.id in specials or part.value.id in names):
                options = specials.get(part.value.id) or names[part.value.id]
            else:
                return None
            out = [a + b for a in out for b in options]
        return out
    return None


#: (module, line) of dynamic imports whose target the source does not say, filled by ``_imports``
UNRESOLVED: list[tuple[str, int]] = []


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The vsekit modules that ``name`` imports (a ``from pkg import sub`` names the submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    # module-level NAME = ("a", "b") tuples, which a loop may run dynamic imports over
    consts = {t.id: vals for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)
              and (vals := _literal_strings(node.value)) is not None}

    def add_dynamic(target: str) -> None:
        parts = target.split(".")
        for k in range(len(parts), 0, -1):   # the module, or the nearest package of it we know
            if ".".join(parts[:k]) in known:
                found.add(".".join(parts[:k]))
                return

    def visit(node: ast.AST, loops: dict[str, list[str]]) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, loops)
            return
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            values = _literal_strings(node.iter)
            if values is None and isinstance(node.iter, ast.Name):
                values = consts.get(node.iter.id)
            if values is not None:
                loops = {**loops, node.target.id: values}
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif target in known:
                    found.add(target)
        elif isinstance(node, ast.Call) and _is_dynamic_import(node) and node.args:
            targets = _dynamic_targets(node.args[0], name, package, loops)
            if targets is None:
                UNRESOLVED.append((name, node.lineno))
            else:
                for target in targets:
                    add_dynamic(target)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for gen in node.generators:   # the loop variables are bound before the element is read
                visit(gen, loops)
                if isinstance(gen.target, ast.Name) and (vals := _literal_strings(gen.iter)
                                                         or (consts.get(gen.iter.id) if isinstance(gen.iter, ast.Name) else None)):
                    loops = {**loops, gen.target.id: vals}
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, ast.comprehension):
                    visit(child, loops)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, loops)

    visit(tree, {})
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_cycle_finder_sees_a_hand_made_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_graph_reads_lazy_and_relative_imports():
    graph = import_graph()
    # runner imports the store at the top and the clusters package inside a function
    assert "vsekit.storage.store" in graph["vsekit.extract.runner"]
    assert "vsekit.clusters" in graph["vsekit.extract.runner"]


def test_graph_follows_importlib_calls(tmp_path):
    """A module that loads others by name (as the CLI once loaded its command modules) has those
    edges in the graph; a name the source does not say is reported, not silently dropped."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import importlib\n"
        "NAMES = ('a', 'b')\n"
        "for _n in NAMES:\n"
        "    importlib.import_module(f'{__name__}.{_n}')\n"
        "def later():\n"
        "    from importlib import import_module\n"
        "    import_module('pkg.c')\n"
        "    [importlib.import_module(f'{__package__}.{m}') for m in ('d',)]\n"
        "def hidden(x):\n"
        "    importlib.import_module(x)\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e"}
    UNRESOLVED.clear()
    assert _imports("pkg", pkg / "__init__.py", known) == {"pkg.a", "pkg.b", "pkg.c", "pkg.d"}
    assert UNRESOLVED == [("pkg", 10)]
    UNRESOLVED.clear()


def test_every_dynamic_import_is_visible():
    UNRESOLVED.clear()
    import_graph()
    assert UNRESOLVED == [], f"dynamic imports the import graph cannot follow: {UNRESOLVED}"


def test_cli_loads_its_command_modules_by_plain_import():
    graph = import_graph()
    for mod in ("store", "ingest", "export", "extract", "fne", "tokenize", "train", "pipeline", "report", "embed"):
        assert f"vsekit.cli.{mod}" in graph["vsekit.cli"]
    # the pipeline runs the CLI's commands through the group it is handed, never by importing the CLI
    assert not any(m == "vsekit.cli" or m.startswith("vsekit.cli.") for m in graph["vsekit.pipeline.executor"])


def test_no_import_circles():
    found = cycles(import_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_image_error_lives_in_storage(tmp_path):
    """Storage raises the image error without importing extraction for it; extraction re-exports it."""
    from vsekit.extract.images import ImageError as from_extract
    from vsekit.storage.base import ImageError
    from vsekit.storage.sources import shards

    assert from_extract is ImageError
    with pytest.raises(ImageError, match="missing container file"):
        shards.read_bytes(f"{tmp_path}/nope.tar::a.jpg@0+10")
    graph = import_graph()
    uses = {m for m in graph["vsekit.storage.sources.shards"] if m.startswith("vsekit.extract")}
    assert uses == set()   # it reads the bytes; extraction decodes them (extract.images.load_ref_image)


# --- layers (docs/architecture.md, "Layers") ---------------------------------------------------------
#: bottom up; a module belongs to the layer of its longest matching prefix ("vsekit" alone: only the
#: package itself); it may import its own layer and those below, never one above
LAYERS = (
    ("foundation", ("vsekit", "vsekit.version", "vsekit.suggest", "vsekit.words", "vsekit.digest", "vsekit.interrupts",
                    "vsekit.allocator", "vsekit.devices", "vsekit.cluster_pin")),
    ("schedulers", ("vsekit.schedulers", "vsekit.clusters")),
    ("storage", ("vsekit.storage",)),
    ("stages", ("vsekit.extract", "vsekit.fne", "vsekit.tokenize", "vsekit.models", "vsekit.train",
                "vsekit.report")),
    ("pipeline", ("vsekit.pipeline",)),
    ("cli", ("vsekit.cli",)),
)


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for level, (_name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p == "vsekit"
            if module == p or (not exact_only and module.startswith(p + ".")):
                if best is None or len(p) > best[1]:
                    best = (level, len(p))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as ``a (layer) -> b (layer)``."""
    out = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            lm, lt = layer_of(m), layer_of(t)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} ({LAYERS[lm][0]}) -> {t} ({LAYERS[lt][0]})")
    return out


def test_every_module_is_in_a_layer():
    assert [m for m in import_graph() if layer_of(m) is None] == []


def test_imports_go_only_sideways_or_down():
    """The layer rule of docs/architecture.md over the whole import graph, imports inside functions
    and dynamic ones included."""
    found = upward_imports(import_graph())
    assert found == [], "upward imports: " + "; ".join(found)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """A storage module importing a stage inside a function is caught; a stage importing storage is not."""
    (tmp_path / "mod.py").write_text("def later():\n    from ..extract import images\n    return images\n")
    known = {"vsekit.storage.mod", "vsekit.extract", "vsekit.extract.images"}
    edges = _imports("vsekit.storage.mod", tmp_path / "mod.py", known)
    assert edges == {"vsekit.extract.images"}
    assert upward_imports({"vsekit.storage.mod": edges}) == [
        "vsekit.storage.mod (storage) -> vsekit.extract.images (stages)"]
    assert upward_imports({"vsekit.extract.images": {"vsekit.storage.base"}, "vsekit.cli": {"vsekit.pipeline"},
                           "vsekit.fne.derived": {"vsekit.extract.job"}}) == []
    assert upward_imports({"vsekit.clusters": {"vsekit.storage.store"}}) != []
    assert upward_imports({"vsekit.schedulers.slurm": {"vsekit.clusters.jobqueue"}}) == []


def test_storage_asks_schedulers_by_name_and_imports_none_of_their_modules():
    """Storage asks ``vsekit.schedulers.get(recorded_name)``; what one scheduler is lives in its module."""
    graph = import_graph()
    used = {t for m, targets in graph.items() if m.startswith("vsekit.storage") for t in targets
            if t.startswith("vsekit.schedulers")}
    assert used == {"vsekit.schedulers"}


def test_the_architecture_page_names_every_layer():
    text = (ROOT.parents[1] / "docs" / "architecture.md").read_text()
    layers = text[text.index("## Layers"):text.index("## Extraction")]
    for _name, prefixes in LAYERS:
        for p in prefixes:
            path = "src/" + p.replace(".", "/") + ("" if p in ("vsekit",) else "")
            assert path in layers or path + ".py" in layers or path + "/" in layers, p
