"""Optimizers across strategies: which run with the same math as one process where (rule.py), Adafactor on DTensor
shards (adafactor.py), several optimizers stepped as one (combined.py)."""

from lightscale.optim.adafactor import ShardedAdafactor
from lightscale.optim.combined import CombinedOptimizer
from lightscale.optim.rule import ATTRIBUTE, ParameterView, check_optimizers, runs_exactly, shape_dependence

__all__ = [
    "ATTRIBUTE",
    "CombinedOptimizer",
    "ParameterView",
    "ShardedAdafactor",
    "check_optimizers",
    "runs_exactly",
    "shape_dependence",
]
