"""DiLoCo's engine, torch only: :class:`OuterSync` (the outer optimizer, its schedule of fragments and its wire),
which the ``diloco`` strategies drive (lightscale/strategies/diloco/). It stays below the strategies because fault
tolerance's per-round mode (lightscale/fault_tolerance/diloco.py: workers that may fail and rejoin) builds on it.

``FaultTolerance``, ``FaultTolerantOuterSync`` and ``RoundRecord`` moved to lightscale.fault_tolerance; the docs
showed ``from lightscale.parallel.diloco import FaultTolerance``, so for a release these names still resolve here,
with a ``DeprecationWarning`` (a module ``__getattr__``: the one import that may run up the floors, for old names).
"""

import importlib
import warnings
from typing import Any

from lightscale.parallel.diloco.outer_settings import (
    MODES,
    check_outer_settings,
    check_synchronous_steps,
    default_outer_step,
    nesterov_outer_optimizer,
    sgd_outer_optimizer,
)
from lightscale.parallel.diloco.outer_sync import OuterSync
from lightscale.parallel.diloco.schedule import Schedule, split_fragments
from lightscale.parallel.diloco.wire import Codec

__all__ = [
    "MODES",
    "Codec",
    "OuterSync",
    "Schedule",
    "check_outer_settings",
    "check_synchronous_steps",
    "default_outer_step",
    "nesterov_outer_optimizer",
    "sgd_outer_optimizer",
    "split_fragments",
]

# old documented name -> its module in lightscale.fault_tolerance
_MOVED = {
    "FaultTolerance": "lightscale.fault_tolerance.settings",
    "FaultTolerantOuterSync": "lightscale.fault_tolerance.diloco",
    "RoundRecord": "lightscale.fault_tolerance.diloco",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"lightscale.parallel.diloco.{name} moved to {_MOVED[name]}; import it from there",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
