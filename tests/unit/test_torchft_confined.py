"""torchft is imported only in lightscale/fault_tolerance/ (the ``[ft]`` extra, STYLE.md lesson 27): no other module
imports it, at module level or inside a function, or names it as a module in a string (``find_spec("torchft")``,
``import_module("torchft.manager")``); prose that mentions torchft is fine."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lightscale"
ALLOWED = "fault_tolerance/"
MODULE_NAME = re.compile(r"torchft(\.\w+)*")  # a string that is a module name, not a sentence


def torchft_mentions(path: Path) -> list[str]:
    """``line: what`` for every import of torchft and every string naming one of its modules in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "torchft"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torchft":
            found.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def files_importing_torchft() -> dict[str, list[str]]:
    return {
        path.relative_to(ROOT).as_posix(): found
        for path in sorted(ROOT.rglob("*.py"))
        if not path.relative_to(ROOT).as_posix().startswith(ALLOWED) and (found := torchft_mentions(path))
    }


def test_only_fault_tolerance_imports_torchft() -> None:
    assert files_importing_torchft() == {}, "torchft belongs in lightscale/fault_tolerance/ (ask its functions)"


def test_fault_tolerance_does_import_it() -> None:
    """The check looks where torchft is: the package itself imports it (else the rule would pass vacuously)."""
    assert torchft_mentions(ROOT / "fault_tolerance" / "settings.py")


def test_the_check_sees_a_planted_import(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import importlib.util\n"
        '"""Runs on torchft, in prose."""\n'
        'ok = importlib.util.find_spec("torchft")\n'
        "def start():\n"
        "    import torchft.manager\n"
        "    from torchft.process_group import ProcessGroupGloo\n"
        '    return importlib.import_module("torchft._torchft")\n'
    )
    assert sorted(torchft_mentions(planted)) == [
        "3: 'torchft'",
        "5: import torchft.manager",
        "6: from torchft.process_group import",
        "7: 'torchft._torchft'",
    ]
