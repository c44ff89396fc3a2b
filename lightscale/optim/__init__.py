"""Optimizers across strategies: which run with the same math as one process where (rule.py), Adafactor on DTensor
shards (adafactor.py), Muon on DTensor shards (muon.py), several optimizers stepped as one (combined.py)."""

from lightscale.optim.adafactor import ShardedAdafactor
from lightscale.optim.combined import CombinedOptimizer
from lightscale.optim.muon import ShardedMuon
from lightscale.optim.rule import ATTRIBUTE, ParameterView, check_optimizers, runs_exactly, shape_dependence

__all__ = [
    "ATTRIBUTE",
    "CombinedOptimizer",
    "ParameterView",
    "ShardedAdafactor",
    "ShardedMuon",
    "check_optimizers",
    "runs_exactly",
    "shape_dependence",
]
