"""DiLoCo and local SGD as a torch-only building block: :class:`OuterSync` (the Lightning strategy comes later).

:class:`FaultTolerantOuterSync` runs it across workers that may fail and rejoin (torchft, the ``[ft]`` extra).
"""

from lightscale.parallel.diloco.fault_tolerant import FaultTolerantOuterSync, RoundRecord
from lightscale.parallel.diloco.outer_sync import OuterSync, nesterov_outer_optimizer
from lightscale.parallel.diloco.schedule import Schedule, split_fragments
from lightscale.parallel.diloco.wire import Codec

__all__ = [
    "Codec",
    "FaultTolerantOuterSync",
    "OuterSync",
    "RoundRecord",
    "Schedule",
    "nesterov_outer_optimizer",
    "split_fragments",
]
