"""Without ``fault_tolerant=`` bucketed_ddp is untouched: torchft (the optional ``[ft]`` extra) is imported only inside
the functions that build a manager or a lighthouse, never when a module loads, and the strategy holds no replica."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lightscale"


def _module_level_torchft_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    inside_functions = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        if id(node) not in inside_functions and any(name.split(".")[0] == "torchft" for name in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_torchft_is_imported_only_where_a_manager_or_lighthouse_is_built() -> None:
    found = [where for path in sorted(ROOT.rglob("*.py")) for where in _module_level_torchft_imports(path)]
    assert found == []


def test_bucketed_ddp_without_fault_tolerant_holds_no_replica() -> None:
    from lightscale.strategies import BucketedDDPStrategy

    strategy = BucketedDDPStrategy()
    assert strategy.ft is None
