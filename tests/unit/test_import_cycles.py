"""No lightscale module imports a module that imports it, directly or around a longer loop.

test_import_layers.py judges the floors between parts (``lightscale.X``); this test looks inside them, module by
module. Every explicit import counts: top-level ones, ones under ``if TYPE_CHECKING:`` (a type-only cycle still
means two modules each need the other, and breaks as soon as the type is needed at runtime) and ones inside
functions. The implicit import of a parent package's ``__init__`` is not an edge: ``from a.b import c`` runs
``a/__init__.py``, but that is how Python finds ``a.b``, not a dependency of the importing module.

The modules are parsed with ``ast``, never imported, so a cycle that would break the import is still reported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lightscale"

# An edge: importing module -> imported module -> "file:line import ..." of each import that makes it.
Graph = dict[str, dict[str, list[str]]]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The lightscale modules one import statement names: ``import a.b`` -> a.b; ``from a.b import c`` -> a.b.c
    where c is a submodule, else a.b; relative imports resolved against ``module``'s package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{anchor}.{base}" if base else anchor
    found = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        found.append(submodule if submodule in known else base)
    return found


def _edges(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int, str]]:
    """(imported lightscale module, line, the import statement) of each import in ``source``."""
    found = []
    # ast.walk reaches every import: module level, under `if TYPE_CHECKING:`, inside functions and classes
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            statement = " ".join((ast.get_source_segment(source, node) or ast.unparse(node)).split())
            for target in _imported_modules(node, module, is_package, known):
                if target in known and target != module:
                    found.append((target, node.lineno, statement))
    return found


def _graph() -> Graph:
    modules = _modules()
    known = set(modules)
    graph: Graph = {}
    for module, path in modules.items():
        for target, line, statement in _edges(path.read_text(), module, path.name == "__init__.py", known):
            where = f"{path.relative_to(ROOT.parent)}:{line} {statement}"
            graph.setdefault(module, {}).setdefault(target, []).append(where)
    return graph


def _components(graph: Graph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph.get(root, {}))))]
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph.get(target, {})))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return sorted(groups)


def _describe(group: list[str], graph: Graph) -> str:
    """The group, then one import line for each edge inside it: what to move or hand over."""
    members = set(group)
    edges = [
        f"    {source} -> {target}: {wheres[0]}"
        for source in group
        for target, wheres in sorted(graph.get(source, {}).items())
        if target in members
    ]
    return f"  cycle between {', '.join(group)}:\n" + "\n".join(edges)


def test_no_module_imports_a_module_that_imports_it() -> None:
    graph = _graph()
    cycles = _components(graph)
    assert not cycles, (
        "import cycles between lightscale modules (move what both need to a lower module, or take a Protocol):\n"
        + "\n".join(_describe(group, graph) for group in cycles)
    )


def test_the_graph_sees_every_kind_of_import() -> None:
    """The finder itself: relative, type-only and in-function imports are edges; a package's __init__ is not."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import base\n"
        "from ..checkpoint import portable\n"
        "import lightscale.errors\n"
        "if TYPE_CHECKING:\n"
        "    from .registry import Registry\n"
        "def f():\n"
        "    from lightscale.parallel.mesh import ParallelDims\n"
    )
    known = {
        "lightscale",
        "lightscale.errors",
        "lightscale.checkpoint",
        "lightscale.checkpoint.portable",
        "lightscale.parallel",
        "lightscale.parallel.mesh",
        "lightscale.strategies",
        "lightscale.strategies.base",
        "lightscale.strategies.checkpointer",
        "lightscale.strategies.registry",
    }
    edges = _edges(source, "lightscale.strategies.checkpointer", False, known)
    assert sorted(target for target, _, _ in edges) == [
        "lightscale.checkpoint.portable",
        "lightscale.errors",
        "lightscale.parallel.mesh",
        "lightscale.strategies.base",
        "lightscale.strategies.registry",
    ]
    # in a package's __init__, "." is the package itself
    package_edges = _edges("from .base import Strategy\n", "lightscale.strategies", True, known)
    assert [target for target, _, _ in package_edges] == ["lightscale.strategies.base"]


def test_components_finds_a_loop_and_ignores_a_chain() -> None:
    graph: Graph = {"a": {"b": ["x"]}, "b": {"c": ["x"]}, "c": {"a": ["x"]}, "d": {"a": ["x"]}}
    assert _components(graph) == [["a", "b", "c"]]
    assert _components({"a": {"b": ["x"]}}) == []
