"""No strategy family's name is typed as a string outside the module of the class that declares the family.

A family is a class that declares its own part of the precision contract (``precision_rules``, a ``PrecisionRules``
built in its module): ``bucketed_ddp``, ``zero``, ``fsdp2``, ``parallel_3d``. The names are read from the classes,
not typed here. Everything else asks the class: the contract's functions take its rules, DiLoCo's ``inner=`` names
and the estimator's default are ``cls.default_name()``, an out-of-memory report's proposals are class data
(``memory_alternatives``), ``export-zero`` / ``export-fsdp2`` name checkpoint formats.

The scan reads every string constant of lightscale/ (``ast``) equal to a family name. A name inside a longer
string (a docstring's example, a message naming the strategy to use) is not a use as a key and is not counted.
``diloco`` is not in the set: DiLoCo declares no rules of its own (its workers run the inner strategy's), and the
string names other things owned elsewhere: the outer-sync mode (``parallel/diloco/outer_settings.py``) and the
checkpoint section (``strategies/diloco/saved_state.py``).

The same scan holds every registered strategy name (``aliases``: ``zero3``, ``fsdp2_offload``, ...) to the module of
the class that registers it, except DiLoCo's names that are also its outer-sync modes (``MODES``: ``diloco``,
``local_sgd``), which ``parallel/diloco/outer_settings.py`` owns as values of ``mode=``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from lightscale.parallel.diloco.outer_settings import MODES
from lightscale.strategies.registry import strategy_classes

ROOT = Path(__file__).resolve().parents[2] / "lightscale"
# (file under lightscale/, string) -> why it is not a family name there.
NOT_A_FAMILY = {
    ("recipes/vit/data.py", "zero"): "the English name of the digit 0 in the ViT/CLIP recipe's captions",
}


def _owners() -> dict[str, Path]:
    """family name -> the module of the first registered class with those rules (later ones inherit or borrow)."""
    owners: dict[str, Path] = {}
    for cls in strategy_classes():
        if cls.precision_rules is not None:
            owners.setdefault(cls.precision_rules.family, Path(inspect.getfile(cls)).resolve())
    return owners


def _name_owners() -> dict[str, Path]:
    """registered strategy name -> the module of the class that registers it (but DiLoCo's mode names)."""
    return {
        name: Path(inspect.getfile(cls)).resolve()
        for cls in strategy_classes()
        for name in cls.__dict__["aliases"]
        if name not in MODES
    }


def _strays(root: Path, owners: dict[str, Path]) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owners):
                continue
            if owners[node.value] != path.resolve() and (where, node.value) not in NOT_A_FAMILY:
                owner = owners[node.value]
                declared = f"{owner.parent.name}/{owner.name}"
                found.append(f"lightscale/{where}:{node.lineno} {node.value!r} (declared in {declared})")
    return found


def test_family_names_only_in_their_class_module() -> None:
    owners = _owners()
    assert {"bucketed_ddp", "zero", "fsdp2", "parallel_3d"} <= set(owners)  # the scan is not vacuous
    strays = _strays(ROOT, owners)
    assert not strays, "family names typed outside their class's module (ask the class instead):\n" + "\n".join(strays)


def test_strategy_names_only_in_their_class_module() -> None:
    owners = _name_owners()
    assert {"zero3", "fsdp2_offload", "tp2", "streaming_diloco"} <= set(owners)
    strays = _strays(ROOT, owners)
    assert not strays, "strategy names typed outside their class's module (ask the class):\n" + "\n".join(strays)


def test_every_exception_still_holds() -> None:
    """An exception whose string is gone is removed, so the list stays the few that are needed."""
    for where, name in NOT_A_FAMILY:
        constants = {n.value for n in ast.walk(ast.parse((ROOT / where).read_text())) if isinstance(n, ast.Constant)}
        assert name in constants, f"{where} no longer holds {name!r}: drop it from NOT_A_FAMILY"


def test_a_planted_family_string_fails(tmp_path: Path) -> None:
    """The planted error: a table keyed by a family's name in a callback is found."""
    planted = tmp_path / "callbacks" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('ONLY_UNDER = {"powersgd": ("bucketed_ddp",)}\n')
    found = _strays(tmp_path, _owners())
    assert found == ["lightscale/callbacks/planted.py:1 'bucketed_ddp' (declared in ddp/strategy.py)"]
