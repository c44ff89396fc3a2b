"""Helpers shared by the benchmarks: a step timer and a robust summary of interleaved repeats."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace
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


class LossStepTimer(StepTimer):
    """StepTimer that also keeps every step's loss (outside the timed span), to show both sides did the same work."""

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.losses.append(float(outputs["loss"]))


def timed_trainer(strategy: str, *, devices: int, steps: int, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    """A lightscale Trainer that only trains and times: no logging, checkpoints, progress bar or validation."""
    import lightscale

    return lightscale.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
        **kwargs,
    )


def stub_trainer(max_steps: int) -> Any:
    """The two Trainer attributes the GPT recipe reads in a hand-written loop: max_steps (LR schedule) and the
    data-parallel shard (every rank its own)."""
    import torch.distributed as dist

    shard = {"num_replicas": dist.get_world_size(), "rank": dist.get_rank()}
    return SimpleNamespace(max_steps=max_steps, strategy=SimpleNamespace(distributed_sampler_kwargs=shard))


def median(values: list[float]) -> float:
    return statistics.median(values)


def interleaved(names: list[str], repeats: int) -> list[str]:
    """ABBA order (A B, B A, A B, ...) so drift in machine speed hits every candidate alike."""
    order: list[str] = []
    for r in range(repeats):
        order.extend(names if r % 2 == 0 else reversed(names))
    return order
