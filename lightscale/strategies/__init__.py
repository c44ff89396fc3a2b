"""Parallelism strategies; each class registers its names in Lightning's ``StrategyRegistry`` when defined."""

from lightscale.parallel.mesh import ParallelDims

# The order of definition is the order of `lightscale strategies` and of the planner's candidates (least
# communication first), so these imports are not sorted.
# isort: off
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.bucketed_ddp import BucketedDDPStrategy
from lightscale.strategies.zero import ZeroStrategy
from lightscale.strategies.fsdp2 import FSDP2Strategy
from lightscale.strategies.parallel_3d.strategy import Parallel3DStrategy
from lightscale.strategies.diloco.strategy import DiLoCoStrategy
from lightscale.strategies.fit_memory import FitMemoryStrategy

# isort: on
from lightscale.strategies.registry import check_strategy, register_strategies, strategy_table

__all__ = [
    "BucketedDDPStrategy",
    "DiLoCoStrategy",
    "FSDP2Strategy",
    "FitMemoryStrategy",
    "LightscaleStrategy",
    "Parallel3DStrategy",
    "ParallelDims",
    "ZeroStrategy",
    "check_strategy",
    "register_strategies",
    "strategy_table",
]
