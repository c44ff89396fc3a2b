"""Old home of :mod:`lightscale.checkpoint.deepspeed_dir`, kept for a release because docs/strategies/zero.md showed
``from lightscale.zero.checkpoint_dir import consolidate_zero_checkpoint``: importing it warns and gives the same
function."""

from __future__ import annotations

import warnings

from lightscale.checkpoint.deepspeed_dir import consolidate_zero_checkpoint

__all__ = ["consolidate_zero_checkpoint"]

warnings.warn(
    "lightscale.zero.checkpoint_dir moved to lightscale.checkpoint.deepspeed_dir; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
