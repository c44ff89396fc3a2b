"""Old home of :mod:`lightscale.strategies.diloco.inner` (a strategy inside a DiLoCo worker), kept for a release
because docs/strategies/diloco.md showed ``lightscale.strategies.inner``: importing it warns and gives the same
names."""

from __future__ import annotations

import warnings

from lightscale.strategies.diloco.inner import InnerStrategy

__all__ = ["InnerStrategy"]

warnings.warn(
    "lightscale.strategies.inner moved to lightscale.strategies.diloco.inner; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
