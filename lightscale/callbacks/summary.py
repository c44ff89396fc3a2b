"""A closing summary of a training run: first/last loss, tokens per second, model-state bytes per rank."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightscale.callbacks.measured_state import ModelStateBytes, model_state_bytes
from lightscale.callbacks.throughput import Throughput
from lightscale.data.data_shard import data_shard
from lightscale.plugins.precision_contract import PRECISIONS, meaning, normalize_precision
from lightscale.strategies.base import LightscaleStrategy


class RunSummary(Callback):
    """Logs ``summary/*`` metrics and prints one table when training ends.

    Losses are averaged over ranks; tokens/s counts every data-parallel rank's tokens and excludes the first
    step (warm-up); model-state bytes are measured on each rank after the first optimizer step.
    """

    def __init__(self) -> None:
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.tokens = 0
        self.started: float | None = None
        self.elapsed = 0.0
        self.state_bytes: ModelStateBytes | None = None

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None or (not trainer.is_last_batch and not _is_step_boundary(trainer, batch_idx)):
            return
        loss = float(trainer.strategy.reduce(loss.detach().float(), reduce_op="mean"))
        loss *= trainer.accumulate_grad_batches  # Lightning reports the loss divided by the accumulation
        self.last_loss = loss
        if self.first_loss is None:
            self.first_loss = loss
            self.state_bytes = model_state_bytes(pl_module, trainer.optimizers, strategy=trainer.strategy)
            self.started = time.perf_counter()
        else:
            self.tokens += _tokens(batch) * trainer.accumulate_grad_batches * data_shard(trainer).count
            self.elapsed = time.perf_counter() - self.started

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # on_train_end, not on_fit_end: the strategy has not torn down the process group yet.
        if self.first_loss is None:
            return
        per_rank = _gather(self.state_bytes)
        tokens_per_s = self.tokens / self.elapsed if self.elapsed else float("nan")
        metrics = {"summary/first_loss": self.first_loss, "summary/last_loss": self.last_loss}
        metrics["summary/tokens_per_s"] = tokens_per_s
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        rank_zero_info(_format(self.first_loss, self.last_loss, tokens_per_s, per_rank, trainer))


def _is_step_boundary(trainer: Trainer, batch_idx: int) -> bool:
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0


def _tokens(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    return first.numel() if isinstance(first, torch.Tensor) else 0


def _gather(value: ModelStateBytes | None) -> list[ModelStateBytes | None]:
    if not dist.is_initialized():
        return [value]
    gathered: list[ModelStateBytes | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _format(
    first: float, last: float, tokens_per_s: float, per_rank: list[ModelStateBytes | None], trainer: Trainer
) -> str:
    lines = [
        "",
        f"lightscale run summary ({type(trainer.strategy).__name__}, {trainer.world_size} rank(s), "
        f"{trainer.global_step} steps)",
        f"  loss: first {first:.4f} -> last {last:.4f}",
        f"  throughput: {tokens_per_s:,.0f} tokens/s (all ranks, first step excluded)",
        "  model-state bytes per rank (parameters + gradients + optimizer = total):",
    ]
    for rank, sizes in enumerate(per_rank):
        if sizes is not None:
            lines.append(
                f"    rank {rank}: {sizes.parameters:,} + {sizes.gradients:,} + {sizes.optimizer:,} = {sizes.total:,}"
            )
    lines += _engine_note(trainer)
    lines += _fault_tolerance_note(trainer)
    for meter in (c for c in trainer.callbacks if isinstance(c, Throughput) and c.history):
        lines.append(
            f"  compute: {meter.mean('tflops_per_s'):.4g} TFLOP/s (all ranks), MFU {meter.mean('mfu'):.1%} "
            "(Throughput callback, first step excluded)"
        )
    return "\n".join(lines)


def _fault_tolerance_note(trainer: Trainer) -> list[str]:
    """Per-step fault tolerance: the steps this replica committed with fewer replicas, and those dropped."""
    strategy = trainer.strategy  # bucketed_ddp or the FSDP2 family with fault_tolerant= holds a replica
    ft = strategy.per_step_replica if isinstance(strategy, LightscaleStrategy) else None
    return [f"  fault tolerance: {ft.summary()}"] if ft is not None else []


def _engine_note(trainer: Trainer) -> list[str]:
    """The precision contract's engine difference that changes no value (the ones that do are warned at start-up)."""
    rules = getattr(trainer.strategy, "precision_rules", None)  # None for a strategy not from lightscale
    precision = normalize_precision(trainer.precision)
    if rules is None or precision not in PRECISIONS:
        return []
    row = meaning(rules, precision)
    return [f"  engine: {row.difference} ({precision} under {rules.family})"] if row.same_values else []
