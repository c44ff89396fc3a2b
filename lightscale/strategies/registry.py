"""lightscale's strategies as derived from their classes: names, descriptions, families, planner candidates.

Every class that declares ``aliases`` registered itself when it was defined (``LightscaleStrategy.__init_subclass__``:
Lightning's ``StrategyRegistry`` and :data:`~lightscale.strategies.base.REGISTERED`), so a subclass in a user's own
file is known here like the built-in ones; nothing below types a strategy's name a second time.

Example:
    >>> import lightscale, lightning
    >>> lightning.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2)
"""

from __future__ import annotations

import difflib

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightscale.errors import ConfigurationError
from lightscale.estimate.plan import Plannable
from lightscale.patches.lightning import check_strategy_names
from lightscale.plugins.precision_contract import PrecisionRules
from lightscale.strategies.base import REGISTERED, LightscaleStrategy


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


def strategy_table() -> list[tuple[str, str]]:
    """(name, one-line description) of every lightscale strategy, in registration order."""
    return [(name, description) for cls in REGISTERED for name, (description, _) in cls.__dict__["aliases"].items()]


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


def check_strategy(strategy: str | Strategy) -> None:
    """Raise a ValueError naming the closest valid strategy if ``strategy`` is an unknown name."""
    if not isinstance(strategy, str) or strategy.lower() == "auto" or strategy.lower() in StrategyRegistry:
        return
    ours = [name for name, _ in strategy_table()]
    theirs = sorted(set(StrategyRegistry.available_strategies()) - set(ours))
    closest = difflib.get_close_matches(strategy.lower(), ["auto", *ours, *theirs], n=1, cutoff=0.5)
    hint = f" Did you mean {closest[0]!r}?" if closest else ""
    raise ConfigurationError(
        f"Unknown strategy {strategy!r}.{hint} lightscale strategies: {', '.join(ours)}. "
        f"Lightning strategies: auto, {', '.join(theirs)}. Run `lightscale strategies` for descriptions."
    )


def check_strategy_in_lightning() -> None:
    """Make plain ``lightning.Trainer(strategy=...)`` raise :func:`check_strategy`'s error for an unknown name.

    Lightning's own message lists only its names ("auto, ddp, ddp_spawn, deepspeed, ..."). Its accelerator
    connector checks the name first thing in ``_check_config_and_set_final_flags``; lightscale runs its check just
    before, so a known name takes Lightning's path unchanged. Idempotent (runs on ``import lightscale``).

    Example:
        >>> import lightscale, lightning
        >>> lightning.Trainer(strategy="zero3_ofload")  # ConfigurationError: ... Did you mean 'zero3_offload'?
    """
    check_strategy_names(check_strategy)  # the rebinding and why: lightscale/patches/lightning.py
