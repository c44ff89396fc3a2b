"""lightscale's strategies as derived from their classes: names, descriptions, families, planner candidates.

Every class that declares ``aliases`` registered itself when it was defined (``LightscaleStrategy.__init_subclass__``:
Lightning's ``StrategyRegistry`` and :data:`~lightscale.strategies.names.REGISTERED`), so a subclass in a user's own
file is known here like the built-in ones; nothing below types a strategy's name a second time.

Example:
    >>> import lightscale, lightning
    >>> lightning.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2)
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightscale.estimate.plan import Plannable
from lightscale.plugins.precision_contract import PrecisionRules
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.names import REGISTERED, check_strategy, strategy_table

__all__ = [
    "check_strategy",
    "family_members",
    "memory_alternatives",
    "plan_candidates",
    "register_strategies",
    "strategy_classes",
    "strategy_table",
    "unregister_strategy",
]


def strategy_classes() -> tuple[type[LightscaleStrategy], ...]:
    """Every class that registered aliases, in the order they were defined."""
    return tuple(REGISTERED)


def register_strategies() -> None:
    """Register every lightscale strategy name again (idempotent; the classes did it when defined)."""
    for cls in REGISTERED:
        cls.register_strategies(StrategyRegistry)


def unregister_strategy(cls: type[LightscaleStrategy]) -> None:
    """Forget ``cls`` and its names (e.g. a test's strategy class, after the test)."""
    if cls in REGISTERED:
        REGISTERED.remove(cls)
    for name in cls.__dict__.get("aliases", {}):
        if dict.get(StrategyRegistry, name, {}).get("strategy") is cls:
            StrategyRegistry.remove(name)


def family_members() -> dict[PrecisionRules, list[str]]:
    """The names under each precision family's rules, in registration order (``precision_contract.render_table``
    shows them): a class that inherits or borrows another's rules (a user's subclass, DiLoCo) joins its family."""
    members: dict[PrecisionRules, list[str]] = {}
    for cls in REGISTERED:
        if cls.precision_rules is not None:
            members.setdefault(cls.precision_rules, []).extend(cls.__dict__["aliases"])
    return members


def plan_candidates() -> list[Plannable]:
    """What ``fit_memory`` and ``lightscale plan`` may choose, in registration order (least communication first)."""
    return [option for cls in REGISTERED for option in cls.__dict__.get("plannable", ())]


def memory_alternatives() -> list[tuple[str, str | None]]:
    """What an out-of-memory report proposes, (name, activation checkpointing), in registration order (least
    communication first), as each class declares it (``memory_alternatives``)."""
    return [option for cls in REGISTERED for option in cls.__dict__.get("memory_alternatives", ())]
