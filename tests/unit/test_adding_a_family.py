"""A new strategy family is its class file, its docs page and its tests: the order of the table and the planner is
data (registry.ORDER, new classes after it), the README's strategy table is checked against the registry here, and a
family defined in this file alone is known to the table, the planner and plain ``lightning.Trainer(strategy=NAME)``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import lightning
import pytest

from lightscale.estimate.plan import Plannable
from lightscale.strategies import BucketedDDPStrategy
from lightscale.strategies.registry import (
    ORDER,
    plan_candidates,
    strategy_classes,
    strategy_table,
    unregister_strategy,
)

ROOT = Path(__file__).resolve().parents[2]
NAME = "throwaway_ddp"


def _readme_rows() -> list[tuple[list[str], str]]:
    """(names, docs link) of each row of the README's "## Strategies" table."""
    section = (ROOT / "README.md").read_text().split("## Strategies", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [
        (re.findall(r"`([^`]+)`", row.split("|")[1]), re.findall(r"\]\(([^)]+)\)", row.split("|")[-2])[0])
        for row in rows
    ]


def test_readme_table_lists_every_registered_name_once_by_family_in_registry_order() -> None:
    listed = [name for names, _ in _readme_rows() for name in names]
    assert sorted(listed) == sorted(name for name, _ in strategy_table()) and len(set(listed)) == len(listed)
    family = {name: place for place, cls in enumerate(strategy_classes()) for name in cls.__dict__["aliases"]}
    places = [family[name] for name in listed]
    assert places == sorted(places), "the README groups names by family, in registry.ORDER"


def test_readme_table_links_exist() -> None:
    assert not [link for _, link in _readme_rows() if not (ROOT / link.split("#")[0]).is_file()]


def test_the_order_is_data_not_import_order() -> None:
    assert [cls.__name__ for cls in strategy_classes()] == list(ORDER)


@pytest.fixture
def family() -> Iterator[type[BucketedDDPStrategy]]:
    class ThrowawayDDP(BucketedDDPStrategy):
        """A family as a new class file would declare it: its names, what the planner may choose."""

        aliases = {NAME: ("a throwaway family, defined in a test", {"bucket_cap_mb": 2.0})}
        plannable = (Plannable(NAME, "2Ψ", "a throwaway candidate"),)

    yield ThrowawayDDP
    unregister_strategy(ThrowawayDDP)


def test_a_family_in_one_file_is_known_everywhere(family: type[BucketedDDPStrategy]) -> None:
    assert strategy_classes()[-1] is family  # after the built-in families, without an edit to registry.ORDER
    assert strategy_table()[-1] == (NAME, "a throwaway family, defined in a test")
    assert plan_candidates()[-1].strategy == NAME
    trainer = lightning.Trainer(strategy=NAME, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is family and trainer.strategy.bucket_cap_mb == 2.0
