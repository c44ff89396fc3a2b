"""DiLoCo and local SGD as a torch-only building block: :class:`OuterSync` (the ``diloco`` strategies drive it).

:class:`FaultTolerantOuterSync` runs it across workers that may fail and rejoin (torchft, the ``[ft]`` extra).
"""

from lightscale.parallel.diloco.fault_tolerant import FaultTolerance, FaultTolerantOuterSync, RoundRecord
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
    "FaultTolerance",
    "FaultTolerantOuterSync",
    "OuterSync",
    "RoundRecord",
    "Schedule",
    "check_outer_settings",
    "check_synchronous_steps",
    "default_outer_step",
    "nesterov_outer_optimizer",
    "sgd_outer_optimizer",
    "split_fragments",
]
