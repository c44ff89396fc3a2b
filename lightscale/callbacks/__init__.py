"""Callbacks that do one thing each: run summary, memory by category, throughput and MFU, communication,
periodic checkpoints, initial weights from a checkpoint."""

from lightscale.callbacks.comm import CommMonitor
from lightscale.callbacks.init_weights import InitWeights
from lightscale.callbacks.memory import MemoryProfiler
from lightscale.callbacks.periodic_checkpoint import PeriodicCheckpoint
from lightscale.callbacks.summary import RunSummary
from lightscale.callbacks.throughput import Throughput

__all__ = ["CommMonitor", "InitWeights", "MemoryProfiler", "PeriodicCheckpoint", "RunSummary", "Throughput"]
