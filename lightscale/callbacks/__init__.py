"""Callbacks that do one thing each: run summary (memory, throughput and communication come later)."""

from lightscale.callbacks.summary import RunSummary

__all__ = ["RunSummary"]
