"""lightscale's strategy names in Lightning's ``StrategyRegistry``, and the error for names that are not there.

Example:
    >>> import lightscale, lightning
    >>> lightning.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2)
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from lightscale.errors import ConfigurationError
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.bucketed_ddp import BucketedDDPStrategy
from lightscale.strategies.fit_memory import FitMemoryStrategy
from lightscale.strategies.fsdp2 import FSDP2Strategy
from lightscale.strategies.parallel_3d import Parallel3DStrategy
from lightscale.strategies.zero import ZeroStrategy

STRATEGIES: tuple[type[LightscaleStrategy], ...] = (
    BucketedDDPStrategy,
    ZeroStrategy,
    FSDP2Strategy,
    Parallel3DStrategy,
    FitMemoryStrategy,
)


def register_strategies() -> None:
    """Register every lightscale strategy name (idempotent; runs on ``import lightscale``)."""
    for cls in STRATEGIES:
        cls.register_strategies(StrategyRegistry)


def strategy_table() -> list[tuple[str, str]]:
    """(name, one-line description) of every lightscale strategy, in registration order."""
    return [(name, description) for cls in STRATEGIES for name, (description, _) in cls.aliases.items()]


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
    original = _AcceleratorConnector._check_config_and_set_final_flags
    if getattr(original, "_lightscale_checked", False):
        return

    @functools.wraps(original)
    def checked(self: _AcceleratorConnector, strategy: str | Strategy, *args: Any, **kwargs: Any) -> None:
        check_strategy(strategy)
        original(self, strategy, *args, **kwargs)

    checked._lightscale_checked = True  # type: ignore[attr-defined]
    _AcceleratorConnector._check_config_and_set_final_flags = checked  # type: ignore[method-assign]
