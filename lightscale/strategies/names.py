"""lightscale's strategy names as Lightning sees them: the classes that registered aliases, and the check that names
the closest valid strategy for an unknown one.

The classes register themselves when defined (``LightscaleStrategy.__init_subclass__``, in Lightning's public
``StrategyRegistry`` and in :data:`REGISTERED`); this module imports no strategy, so the base class can install the
check into plain Lightning (strategies/lightning_patches.py) without an import cycle.

Example:
    >>> check_strategy("zero3_ofload")  # ConfigurationError: ... Did you mean 'zero3_offload'? ...
"""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightscale.errors import ConfigurationError

# Every strategy class that declares aliases, in the order they were defined (lightscale/strategies/registry.py).
REGISTERED: list[Any] = []  # list[type[LightscaleStrategy]]: appended by LightscaleStrategy.__init_subclass__


def strategy_table() -> list[tuple[str, str]]:
    """(name, one-line description) of every lightscale strategy, in registration order."""
    return [(name, description) for cls in REGISTERED for name, (description, _) in cls.__dict__["aliases"].items()]


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
