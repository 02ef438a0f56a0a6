"""The package's shape: no import circles among forkrl's modules, and no module too long to read.

The import graph is built from the source with :mod:`ast`, not by importing (which would need every
host installed): an import anywhere in a module counts, at module level or inside a function, since
a function-local import only hides a circle until the function runs. Imports under
``if TYPE_CHECKING:`` are left out (they never run). ``from pkg import name`` is an edge to
``pkg.name`` where that is a module, else to ``pkg`` itself; importing a submodule is not counted as
an edge to its parent package, which Python initialises first but whose ``__init__`` only re-exports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> the package it installs as (pyproject's ``[tool.setuptools.package-dir]``).
PACKAGES = {"core": "forkrl.core", "plugins": "forkrl.plugins"}
#: Longest module in ``core/`` or ``plugins/``, in lines (STYLE.md 11: read in one sitting).
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> set[str]:
    """The forkrl modules one import statement reaches (the nearest enclosing module of each name)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    found = set()
    for target in targets:
        while target and target not in mods:
            target = target.rpartition(".")[0]
        if target and target != module:
            found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    """forkrl module -> the forkrl modules it imports anywhere outside ``TYPE_CHECKING`` blocks."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        edges: set[str] = set()
        stack: list[ast.AST] = [ast.parse(path.read_text(), filename=str(path))]
        while stack:
            node = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    stack.extend(child.orelse)
                elif isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges |= _imported(module, path, child, mods)
                else:
                    stack.append(child)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, iters = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_the_graph_sees_relative_function_level_and_type_checking_imports():
    graph = import_graph()
    assert "forkrl.core.speculative.policy" in graph["forkrl.core.speculative.hf"]  # module level
    assert "forkrl.plugins.verl.engine" in graph["forkrl.plugins.verl"]  # inside register()
    assert "forkrl.plugins.trl.trainer" not in graph["forkrl.plugins.trl.host"]  # TYPE_CHECKING only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circles_among_forkrl_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, (
        "import circle: " + " -> ".join(cycle) + "; move the piece both sides need to the module it "
        "belongs to (a function-local import only hides the circle)"
    )


def test_no_module_in_core_or_plugins_is_too_long_to_read():
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept, STYLE.md 16): {long}"


#: What the product, its benchmarks, scripts and examples are; none of them may import the tests.
SHIPPED = ("core", "plugins", "benchmarks", "scripts", "examples")


def imports_of_tests(path: Path) -> list[str]:
    """Each import in ``path`` (anywhere: module level, in a function, under ``TYPE_CHECKING``) of
    the ``tests`` package or a module in it, as ``line: name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name == "tests" or name.startswith("tests.")]
    return found


def test_imports_of_tests_are_found_wherever_they_are(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os, tests.verl.x\nfrom tests import y\nfrom .tests import z\n"
        "def f():\n    from tests.e2e import cpu_host\n    import testsuite\n"
    )
    assert imports_of_tests(source) == ["1: tests.verl.x", "2: tests", "5: tests.e2e"]


def test_shipped_code_imports_no_test_module():
    """Benchmarks, scripts and examples use the product's test support (``forkrl.core.testing``,
    ``forkrl.plugins.<host>.testing``), never the tests: a test module is free to change."""
    bad = [
        f"{path.relative_to(ROOT)}:{hit}"
        for folder in SHIPPED
        for path in sorted((ROOT / folder).rglob("*.py"))
        for hit in imports_of_tests(path)
    ]
    assert not bad, (
        "imports of the tests (move what they need into the product's test support): " + ", ".join(bad)
    )
