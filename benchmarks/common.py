"""Helpers shared by the benchmarks: a step timer and a robust summary of interleaved repeats."""

from __future__ import annotations

import statistics
import time
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class StepTimer(Callback):
    """Wall time of each training step (forward, backward, communication, optimizer), warm-up steps dropped."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._start)


def median(values: list[float]) -> float:
    return statistics.median(values)


def interleaved(names: list[str], repeats: int) -> list[str]:
    """ABBA order (A B, B A, A B, ...) so drift in machine speed hits every candidate alike."""
    order: list[str] = []
    for r in range(repeats):
        order.extend(names if r % 2 == 0 else reversed(names))
    return order
