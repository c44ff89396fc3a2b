"""docs/architecture.md describes the tree that is there: its module table names every ``.py`` file under lightscale/
exactly once and no file that does not exist, and its folder table puts each folder on the floor that
tests/unit/test_import_layers.py enforces (``FLOORS``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lightscale"
DOC = REPO / "docs" / "architecture.md"
LAYERS = REPO / "tests" / "unit" / "test_import_layers.py"


def _section(text: str, title: str) -> list[str]:
    """The lines of the ``## title`` section, up to the next ``## `` heading."""
    lines = text.splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _table_rows(lines: list[str], header: str) -> list[list[str]]:
    """The cells of each body row of the Markdown table whose header row starts with ``header``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:  # past the header and the |---| line
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows


def documented_modules(text: str) -> list[str]:
    """The file named in the first cell of each row of the "Modules" table, relative to lightscale/."""
    rows = _table_rows(_section(text, "Modules"), "| module |")
    names = []
    for cells in rows:
        match = re.fullmatch(r"`([^`]+\.py)`", cells[0])
        assert match, f"a module row's first cell is not one `path.py`: {cells[0]!r}"
        names.append(match.group(1))
    return names


def documented_floors(text: str) -> dict[str, int]:
    """Module name -> floor, from the "Folders" table (``commands/`` -> ``lightscale.commands``)."""
    floors: dict[str, int] = {}
    for cells in _table_rows(_section(text, "Folders"), "| floor |"):
        floor = int(cells[0])
        for entry in cells[1].split(","):
            path = entry.strip().strip("`").removesuffix("/").removesuffix(".py")
            module = "lightscale." + path.replace("/", ".")
            assert module not in floors, f"{entry.strip()} is on two floors of the folder table"
            floors[module] = floor
    return floors


def enforced_floors() -> dict[str, int]:
    """``FLOORS`` of test_import_layers.py, read from its source (the test module is not a package)."""
    tree = ast.parse(LAYERS.read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "FLOORS" for t in targets):
                assert node.value is not None
                return ast.literal_eval(node.value)
    raise AssertionError(f"no FLOORS in {LAYERS}")


def tree_modules() -> set[str]:
    return {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}


def module_table_problems(documented: list[str], tree: set[str]) -> list[str]:
    problems = [f"row for a file that does not exist: lightscale/{name}" for name in sorted(set(documented) - tree)]
    problems += [f"lightscale/{name} has no row" for name in sorted(tree - set(documented))]
    problems += [
        f"lightscale/{name} has several rows" for name in sorted({n for n in documented if documented.count(n) > 1})
    ]
    return problems


def test_module_table_names_every_file_of_the_tree_once() -> None:
    problems = module_table_problems(documented_modules(DOC.read_text()), tree_modules())
    assert not problems, "docs/architecture.md's module table is not the tree:\n" + "\n".join(problems)


def test_a_row_for_a_missing_file_fails() -> None:
    text = DOC.read_text()
    planted = text.replace(
        "| module | what it is |\n|---|---|\n", "| module | what it is |\n|---|---|\n| `zero/engine.py` | Gone. |\n"
    )
    assert planted != text
    problems = module_table_problems(documented_modules(planted), tree_modules())
    assert "row for a file that does not exist: lightscale/zero/engine.py" in problems


def test_folder_table_is_the_enforced_floors() -> None:
    enforced = {module: floor for module, floor in enforced_floors().items() if module != "lightscale"}
    documented = documented_floors(DOC.read_text())
    differences = [
        f"{module}: table says {documented.get(module)}, FLOORS says {enforced.get(module)}"
        for module in sorted(set(enforced) | set(documented))
        if documented.get(module) != enforced.get(module)
    ]
    assert not differences, "docs/architecture.md's folder table is not FLOORS:\n" + "\n".join(differences)
