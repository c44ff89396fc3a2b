"""Callbacks that do one thing each: run summary, memory by category."""

from lightscale.callbacks.memory import MemoryProfiler
from lightscale.callbacks.summary import RunSummary

__all__ = ["MemoryProfiler", "RunSummary"]
