"""Check that every ``from torch|lightning|deepspeed... import NAME`` in lightscale exists in an older release's source.

The lower bounds in pyproject.toml come from this check (imports only: behaviour is tested on the pinned versions).
Get a release's Python source without installing it (the macOS wheel of torch is CPU-only and small), then run:

    pip download --no-deps --only-binary=:all: --platform macosx_11_0_arm64 --python-version 3.11 -d W torch==2.8.0
    pip download --no-deps -d W lightning==2.5.0 deepspeed==0.16.0
    (cd W && unzip -q torch-2.8.0-*.whl 'torch/*' -d t && unzip -q lightning-*.whl -d l && tar xzf deepspeed-*.tar.gz)
    python .ci/check_min_versions.py W/t W/l W/deepspeed-0.16.0

It prints each import that does not resolve (file, module, name) and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

LIGHTSCALE = Path(__file__).resolve().parent.parent / "lightscale"


def module_file(roots: dict[str, Path], module: str) -> Path | bool | None:
    """The source file of ``module``; None if it is not a checked package; False if it does not exist."""
    root = roots.get(module.split(".")[0])
    if root is None:
        return None
    base = root / Path(*module.split("."))
    candidates = (base.with_suffix(".py"), base / "__init__.py", base.with_suffix(".pyi"), base / "__init__.pyi")
    return next((path for path in candidates if path.exists()), False)


def defines(file: Path, name: str) -> bool:
    pattern = rf"(def|class)\s+{name}\b|^\s*{name}\s*[:=]|import[^\n]*\b{name}\b|^\s*{name},?\s*$|\b{name},"
    if re.search(pattern, file.read_text(), re.MULTILINE):
        return True
    # A package that re-exports its modules' classes dynamically (DeepSpeed's op_builder): look in its modules.
    siblings = file.parent.glob("*.py") if file.name == "__init__.py" else []
    return any(re.search(rf"^class\s+{name}\b", sibling.read_text(), re.MULTILINE) for sibling in siblings)


def missing_imports(roots: dict[str, Path]) -> list[tuple[str, str, str]]:
    missing = []
    for file in sorted(LIGHTSCALE.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                missing += [(file.name, a.name, "(module)") for a in node.names if module_file(roots, a.name) is False]
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            found = module_file(roots, node.module)
            if found is False:
                missing.append((file.name, node.module, "(module)"))
            elif found:
                for alias in node.names:
                    if not module_file(roots, f"{node.module}.{alias.name}") and not defines(found, alias.name):
                        missing.append((file.name, node.module, alias.name))
    return missing


def main(torch_root: str, lightning_root: str, deepspeed_root: str) -> int:
    roots = {"torch": Path(torch_root), "lightning": Path(lightning_root), "deepspeed": Path(deepspeed_root)}
    missing = missing_imports(roots)
    for row in missing:
        print(*row)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
