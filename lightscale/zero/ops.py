"""Old home of :mod:`lightscale.strategies.deepspeed.ops`, kept for a release because the docs showed
``python -m lightscale.zero.ops``: running it warns and builds DeepSpeed's CPU ops as the new module does."""

from __future__ import annotations

import warnings

from lightscale.strategies.deepspeed.ops import build_cpu_ops, extensions_dir

__all__ = ["build_cpu_ops", "extensions_dir"]

warnings.warn(
    "lightscale.zero.ops moved to lightscale.strategies.deepspeed.ops; "
    "run `python -m lightscale.strategies.deepspeed.ops`",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    build_cpu_ops()
