"""parallel_3d: dp x tp x pp x ep x cp on one DeviceMesh; the strategy (strategy.py), the model it builds for this
rank (model.py) and the two step paths it owns: the pipeline (pipeline_step.py) and context parallelism
(context_parallel_step.py)."""

from lightscale.strategies.parallel_3d.strategy import Parallel3DStrategy

__all__ = ["Parallel3DStrategy"]
