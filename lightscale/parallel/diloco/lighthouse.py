"""Old home of :mod:`lightscale.fault_tolerance.lighthouse`, kept for a release because the docs showed
``python -m lightscale.parallel.diloco.lighthouse``: running it warns and starts the same lighthouse."""

from __future__ import annotations

import warnings

from lightscale.fault_tolerance.lighthouse import main

__all__ = ["main"]

warnings.warn(
    "lightscale.parallel.diloco.lighthouse moved to lightscale.fault_tolerance.lighthouse; run "
    "`python -m lightscale.fault_tolerance.lighthouse`",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    main()
