"""Dependencies between lightscale's parts run one way: no import cycle between subpackages / top-level modules
(``lightscale.X``), counting imports inside functions too, and no import of a lightscale module inside a function
(an import hidden in a function to dodge a cycle means the layers are wrong). Third-party imports are ignored:
optional ones may stay lazy. And importing the package (or any module of it) installs Lightning's patches."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightscale"

# The floors of the house (docs/architecture.md's folder map): a part imports only parts on its floor or below.
FLOORS = {
    "lightscale.errors": 0,
    "lightscale.measure": 0,
    "lightscale.patches": 0,
    "lightscale.runtime": 1,
    "lightscale.storage": 1,
    "lightscale.layers": 1,
    "lightscale.parallel": 2,
    "lightscale.optim": 2,
    "lightscale.data": 3,
    "lightscale.plugins": 3,
    "lightscale.estimate": 3,
    "lightscale.checkpoint": 4,
    "lightscale.fault_tolerance": 4,
    "lightscale.strategies": 5,
    "lightscale.callbacks": 6,
    "lightscale.recipes": 6,
    "lightscale.trainer": 7,
    "lightscale.testing": 7,
    "lightscale.commands": 7,
    "lightscale.cli": 8,
    "lightscale": 8,
    # documented old paths of moved modules (re-exports that warn, for a release): nothing of lightscale imports them
    "lightscale.streams": 8,
    "lightscale.comm_counter": 8,
    "lightscale.storage.local_s3": 8,
    "lightscale.zero": 8,
    "lightscale.parallel.diloco.lighthouse": 8,
    "lightscale.strategies.inner": 8,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported lightscale module, inside a function?, line) of every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    anchor = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                found.append((base, in_function, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return [(name, lazy, line) for name, lazy, line in found if name == "lightscale" or name.startswith("lightscale.")]


def _part(module: str) -> str:
    """``lightscale.estimate.core`` -> ``lightscale.estimate``: the node of the layer graph (a module FLOORS names
    itself, an old path's re-export, is its own node)."""
    return module if module in FLOORS else ".".join(module.split(".")[:2])


def _graph() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> the imports ("file:line module") that make the edge."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = _part(_module_name(path))
        for name, _, line in _imports(path):
            target = _part(name)
            if target != source:
                where = f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
                graph.setdefault(source, {}).setdefault(target, []).append(where)
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """One cycle through each strongly connected group of parts (Tarjan), as a list of parts."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return groups


def _describe(group: list[str], graph: dict[str, dict[str, list[str]]]) -> str:
    edges = [
        f"  {source} -> {target}: {graph[source][target][0]}"
        for source in group
        for target in graph.get(source, {})
        if target in group
    ]
    return f"cycle between {', '.join(group)}:\n" + "\n".join(edges)


def test_no_cycle_between_parts() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "\n".join(_describe(group, graph) for group in cycles)


def test_estimate_imports_no_strategy_cli_or_trainer() -> None:
    graph = _graph()
    upward = {"lightscale.strategies", "lightscale.cli", "lightscale.trainer", "lightscale.commands", "lightscale"}
    assert not upward & set(graph.get("lightscale.estimate", {})), graph.get("lightscale.estimate")


def test_no_lightscale_import_inside_a_function() -> None:
    lazy = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
        for path in sorted(ROOT.rglob("*.py"))
        for name, in_function, line in _imports(path)
        if in_function
    ]
    assert not lazy, "imports of lightscale modules inside functions:\n" + "\n".join(lazy)


def test_every_part_has_a_floor() -> None:
    parts = {_part(_module_name(path)) for path in ROOT.rglob("*.py")}
    assert not parts - set(FLOORS), f"place these in FLOORS (and docs/architecture.md): {sorted(parts - set(FLOORS))}"


def test_imports_run_down_the_floors() -> None:
    graph = _graph()
    upward = [
        f"{source} (floor {FLOORS[source]}) -> {target} (floor {FLOORS[target]}): {wheres[0]}"
        for source, targets in graph.items()
        for target, wheres in targets.items()
        if FLOORS.get(target, 0) > FLOORS.get(source, 0)
    ]
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_only_mesh_py_indexes_mesh_axes() -> None:
    """Groups are asked for by role (lightscale/parallel/mesh.py); ``mesh["tp"]`` elsewhere is a second rule."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "parallel" / "mesh.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant | ast.Tuple)):
                continue
            value = node.value
            name = value.attr if isinstance(value, ast.Attribute) else getattr(value, "id", "")
            if name.endswith("mesh"):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {ast.unparse(node)}")
    assert not found, "mesh axes indexed outside parallel/mesh.py:\n" + "\n".join(found)


# ---- importing the package installs Lightning's patches (strategies/registry.py) ----------------------
_PATCHED = """
import importlib, json, sys
from lightning.fabric.utilities import cloud_io
import lightning.fabric.plugins.io.torch_io as torch_io
import lightning.pytorch.core.saving as saving
from lightning.pytorch.strategies.strategy import Strategy
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

def lightnings(function, file):  # the function Lightning defines, not a wrapper of it
    return not hasattr(function, "__wrapped__") and function.__code__.co_filename.endswith(file)

def patched():
    return sorted(name for name, own in [
        ("core.saving.pl_load", saving.pl_load is cloud_io._load),
        ("torch_io.pl_load", torch_io.pl_load is cloud_io._load),
        ("Strategy.load_optimizer_state_dict",
         lightnings(Strategy.load_optimizer_state_dict, "strategies/strategy.py")),
        ("_AcceleratorConnector._check_config_and_set_final_flags",
         lightnings(_AcceleratorConnector._check_config_and_set_final_flags, "accelerator_connector.py")),
    ] if not own)

seen = {}
for module in sys.argv[1:]:
    importlib.import_module(module)
    seen[module] = patched()
import lightning
try:
    lightning.Trainer(strategy="zero3_ofload", accelerator="cpu", devices=1, logger=False)
except ValueError as error:
    seen["typo"] = str(error)
print(json.dumps(seen))
"""
ALL_FOUR = 4  # the two pl_load names, Strategy.load_optimizer_state_dict, the strategy-name check


def _patched_after(*modules: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _PATCHED, *modules], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("statement", ["lightscale", "lightscale.strategies", "lightscale.parallel.mesh"])
def test_importing_the_package_installs_the_lightning_patches(statement: str) -> None:
    """``import lightscale`` (or of any module of it: Python runs the package's ``__init__`` first) is enough: all four
    patches are in place with no strategy built, and plain ``lightning.Trainer`` names the closest match for a mistyped
    name. (Before: none installed, and Lightning's own error listed its names without the closest match.)"""
    seen = _patched_after(statement)
    assert len(seen[statement]) == ALL_FOUR, seen[statement]
    assert "Did you mean 'zero3_offload'?" in str(seen["typo"]), seen.get("typo")
