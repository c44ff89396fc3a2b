"""Precision plugins a strategy owns and the precision contract they follow (checkpoints: lightscale.checkpoint)."""

from lightscale.plugins.precision import check_precision

__all__ = ["check_precision"]
