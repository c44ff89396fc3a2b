"""Optimizers across strategies: which run with the same math as one process where (rule.py)."""

from lightscale.optim.rule import ATTRIBUTE, ParameterView, check_optimizers, runs_exactly, shape_dependence

__all__ = ["ATTRIBUTE", "ParameterView", "check_optimizers", "runs_exactly", "shape_dependence"]
