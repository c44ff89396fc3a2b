"""Callbacks that do one thing each: run summary, memory by category, throughput and MFU."""

from lightscale.callbacks.memory import MemoryProfiler
from lightscale.callbacks.summary import RunSummary
from lightscale.callbacks.throughput import Throughput

__all__ = ["MemoryProfiler", "RunSummary", "Throughput"]
