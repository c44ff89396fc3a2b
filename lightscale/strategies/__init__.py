"""Parallelism strategies; each class registers its names in Lightning's ``StrategyRegistry`` when defined."""

from lightscale.parallel.mesh import ParallelDims

# Importing a class registers its names; their order is registry.ORDER's, not these imports'.
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.checkpointer import Checkpointer
from lightscale.strategies.ddp.strategy import BucketedDDPStrategy
from lightscale.strategies.deepspeed.strategy import ZeroStrategy
from lightscale.strategies.diloco.strategy import DiLoCoStrategy
from lightscale.strategies.fit_memory import FitMemoryStrategy
from lightscale.strategies.fsdp2.strategy import FSDP2Strategy
from lightscale.strategies.parallel_3d.strategy import Parallel3DStrategy
from lightscale.strategies.registry import check_strategy, register_strategies, strategy_table

__all__ = [
    "BucketedDDPStrategy",
    "Checkpointer",
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
