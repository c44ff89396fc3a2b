"""Plugins a strategy owns: precision and checkpoint I/O."""

from lightscale.plugins.checkpoint import SafeCheckpointIO
from lightscale.plugins.precision import check_precision

__all__ = ["SafeCheckpointIO", "check_precision"]
