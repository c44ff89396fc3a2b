"""lightscale: pluggable parallelism strategies for Lightning. Change one word, train at any scale.

Example:
    >>> import lightscale
    >>> trainer = lightscale.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2, max_steps=100)
"""

from lightscale.data import streams
from lightscale.data.data_shard import DataShard, data_shard
from lightscale.fault_tolerance.settings import FaultTolerance
from lightscale.plugins.fsdp_precision import Float8Precision
from lightscale.strategies.registry import patch_lightning, register_strategies, strategy_table
from lightscale.trainer import Trainer

__version__ = "0.1.0"
__all__ = [
    "DataShard",
    "FaultTolerance",
    "Float8Precision",
    "Trainer",
    "__version__",
    "data_shard",
    "patch_lightning",
    "register_strategies",
    "strategy_table",
    "streams",
]

register_strategies()  # in Lightning's public StrategyRegistry
# Lightning reads lightscale checkpoint directories and names the closest strategy (strategies/registry.py).
patch_lightning()
