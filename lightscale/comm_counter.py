"""Old home of :mod:`lightscale.measure.comm_counter`, kept for a release because docs/strategies/diloco.md showed
``from lightscale.comm_counter import SlowLink``: importing it warns and gives the same classes."""

from __future__ import annotations

import warnings

from lightscale.measure.comm_counter import CollectiveCounter, SlowLink, Traffic

__all__ = ["CollectiveCounter", "SlowLink", "Traffic"]

warnings.warn("lightscale.comm_counter moved to lightscale.measure.comm_counter", DeprecationWarning, stacklevel=2)
