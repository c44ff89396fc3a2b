"""DiLoCo and local SGD as a strategy (strategy.py), and its fault-tolerant workers on torchft (fault_tolerant.py)."""

from lightscale.strategies.diloco.strategy import DiLoCoStrategy

__all__ = ["DiLoCoStrategy"]
