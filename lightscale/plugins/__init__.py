"""Plugins a strategy owns: precision and checkpoint I/O."""

from lightscale.plugins.checkpoint import SafeCheckpointIO, allow_in_checkpoints
from lightscale.plugins.precision import check_precision

__all__ = ["SafeCheckpointIO", "allow_in_checkpoints", "check_precision"]
