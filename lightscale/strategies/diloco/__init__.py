"""DiLoCo and local SGD as a strategy (strategy.py); its fault-tolerant workers: lightscale/fault_tolerance/."""

from lightscale.strategies.diloco.strategy import DiLoCoStrategy

__all__ = ["DiLoCoStrategy"]
