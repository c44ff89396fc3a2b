"""What Lightning learns about lightscale's strategies, derived from their classes: names, descriptions, families,
planner candidates, the closest-match check for an unknown name, and the installer of the global Lightning patches.

Every class that declares ``aliases`` registers itself when it is defined (``LightscaleStrategy.__init_subclass__``:
Lightning's ``StrategyRegistry`` and :data:`REGISTERED`), so a subclass in a user's own file is known here like the
built-in ones; nothing below types a strategy's name a second time. The order of the table and of the planner's
candidates is data (:data:`ORDER`), not the order in which modules happen to be imported. This module imports no
strategy class, not even for its types (:class:`StrategyClass` says what it reads of one), so the base class can use
it without an import cycle.

Example:
    >>> import lightscale, lightning
    >>> lightning.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2)
    >>> check_strategy("zero3_ofload")  # ConfigurationError: ... Did you mean 'zero3_offload'? ...
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Protocol

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightscale.checkpoint.lightning_load import install_lightning_loading
from lightscale.errors import ConfigurationError
from lightscale.estimate.plan import Plannable
from lightscale.patches.lightning import check_strategy_names
from lightscale.plugins.precision_contract import PrecisionRules, declare_family

__all__ = [
    "ORDER",
    "REGISTERED",
    "StrategyClass",
    "check_strategy",
    "family_members",
    "memory_alternatives",
    "patch_lightning",
    "plan_candidates",
    "register_strategies",
    "strategy_classes",
    "strategy_table",
    "unregister_strategy",
]

# The built-in families by class name, least communication first: the order of `lightscale strategies`, of the
# precision table, of the planner's candidates and of the names an error lists. A class not named here (a user's, a
# new family) follows them in the order it was defined.
ORDER = (
    "BucketedDDPStrategy",
    "ZeroStrategy",
    "FSDP2Strategy",
    "Parallel3DStrategy",
    "DiLoCoStrategy",
    "FitMemoryStrategy",
)


class StrategyClass(Protocol):
    """What the registry reads of a strategy class (``LightscaleStrategy`` and its subclasses declare it): its names,
    its precision family and how it enters Lightning's ``StrategyRegistry``. The classes register into this module;
    it never imports them."""

    aliases: ClassVar[dict[str, tuple[str, dict[str, Any]]]]
    precision_rules: ClassVar[PrecisionRules | None]

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None: ...


def _place(cls: type) -> int:
    return ORDER.index(cls.__name__) if cls.__name__ in ORDER else len(ORDER)


class _InOrder(list[Any]):  # of type[StrategyClass]
    """A list whose ``append`` puts a class at its :data:`ORDER` place (after the classes of the same place), so the
    order of the strategy modules' imports decides nothing."""

    def append(self, cls: Any) -> None:
        self.insert(sum(1 for known in self if _place(known) <= _place(cls)), cls)


# Every strategy class that declares aliases, in ORDER: appended by LightscaleStrategy.__init_subclass__.
REGISTERED: list[Any] = _InOrder()


def strategy_classes() -> tuple[type[StrategyClass], ...]:
    """Every class that registered aliases: the built-in families in :data:`ORDER`, then the rest as defined."""
    return tuple(REGISTERED)


def strategy_table() -> list[tuple[str, str]]:
    """(name, one-line description) of every lightscale strategy, in :func:`strategy_classes` order."""
    return [
        (name, description) for cls in strategy_classes() for name, (description, _) in cls.__dict__["aliases"].items()
    ]


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


def register_class(cls: type[StrategyClass]) -> None:
    """``cls`` declares ``aliases`` in its own body (``LightscaleStrategy.__init_subclass__``, a user's file too): its
    precision family, its place in :data:`REGISTERED` (in place of a class with the same names), its names in
    Lightning's ``StrategyRegistry``."""
    if cls.precision_rules is not None:
        declare_family(cls.precision_rules)
    own = set(cls.__dict__["aliases"])
    REGISTERED[:] = [known for known in REGISTERED if not own & set(known.__dict__["aliases"])]
    REGISTERED.append(cls)
    cls.register_strategies(StrategyRegistry)


def register_strategies() -> None:
    """Register every lightscale strategy name again (idempotent; the classes did it when defined)."""
    for cls in strategy_classes():
        cls.register_strategies(StrategyRegistry)


def unregister_strategy(cls: type[StrategyClass]) -> None:
    """Forget ``cls`` and its names (e.g. a test's strategy class, after the test)."""
    if cls in REGISTERED:
        REGISTERED.remove(cls)
    for name in cls.__dict__.get("aliases", {}):
        if dict.get(StrategyRegistry, name, {}).get("strategy") is cls:
            StrategyRegistry.remove(name)


def family_members() -> dict[PrecisionRules, list[str]]:
    """The names under each precision family's rules, in table order (``precision_contract.render_table`` shows
    them): a class that inherits or borrows another's rules (a user's subclass, DiLoCo) joins its family."""
    members: dict[PrecisionRules, list[str]] = {}
    for cls in strategy_classes():
        if cls.precision_rules is not None:
            members.setdefault(cls.precision_rules, []).extend(cls.__dict__["aliases"])
    return members


def plan_candidates() -> list[Plannable]:
    """What ``fit_memory`` and ``lightscale plan`` may choose, in table order (least communication first)."""
    return [option for cls in strategy_classes() for option in cls.__dict__.get("plannable", ())]


def memory_alternatives() -> list[tuple[str, str | None]]:
    """What an out-of-memory report proposes, (name, activation checkpointing), in table order (least communication
    first), as each class declares it (``memory_alternatives``)."""
    return [option for cls in strategy_classes() for option in cls.__dict__.get("memory_alternatives", ())]


def patch_lightning() -> None:
    """Install every global Lightning patch lightscale makes (idempotent): on ``import lightscale``, and again first
    thing in every ``LightscaleStrategy`` constructor and in ``lightscale.Trainer``.

    Plain ``lightning.Trainer(strategy=NAME)`` names lightscale's strategies and the closest match for an unknown name;
    ``Model.load_from_checkpoint`` and Lightning's own strategies read lightscale checkpoint directories, and check
    the run's optimizers against the checkpoint's before loading their state. Lightning runs none of lightscale's code
    before it checks a strategy name or reads a checkpoint, so the import is the one point lightscale has; the
    rebindings themselves, with their reasons, are in lightscale/patches/lightning.py.
    """
    check_strategy_names(check_strategy)
    install_lightning_loading()
