"""``Throughput``: tokens/s, samples/s, TFLOP/s and MFU per rank and in total, measured per optimizer step.

FLOPs come from the LightningModule's ``flops_per_batch`` (per micro-batch, the whole model: the GPT recipe sets
it from 6N + 12·L·d·T per token), else are counted once on the first micro-batch with ``FlopCounterMode`` and
multiplied by the data-parallel degree. Every micro-batch of an accumulation counts once; a pipeline's
``training_step`` runs all its microbatches in one call, so it counts once too. Time is wall clock between
optimizer-step boundaries (the first step, a warm-up, excluded). The peak is the GPU table's for the compute
dtype, or on CPU a matmul rate measured once (lightscale/callbacks/flops.py).

Logged through ``trainer.loggers`` as ``throughput/<name>`` every ``log_every_n_steps``; the run summary prints
the means.

Example:
    >>> Trainer(strategy="fsdp2", callbacks=[Throughput()])
    $ lightscale fit --config gpt/small_ddp.yaml --trainer.callbacks+=lightscale.callbacks.Throughput
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightscale.callbacks.flops import flop_counter, peak_flops
from lightscale.data.data_shard import data_shard


class Throughput(Callback):
    """Measures throughput and model FLOPs utilization (see the module docstring).

    Args:
        peak_flops_per_s: the device's peak, overriding the table and the CPU benchmark.
    """

    def __init__(self, *, peak_flops_per_s: float | None = None) -> None:
        self.peak = peak_flops_per_s
        self.history: list[dict[str, float]] = []  # one entry per optimizer step after the first
        self.totals: list[tuple[float, float, float]] = []  # (FLOPs, tokens, samples) of each of those steps
        self._counted_flops: int | None = None  # per micro-batch, this rank's share (FlopCounterMode)
        self._counter: Any = None
        self._step_start: float | None = None
        self._flops = self._tokens = self._samples = 0.0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.peak is None:
            self.peak = peak_flops(pl_module.device, str(trainer.precision))

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = _now(pl_module)
        if _flops_of(pl_module) is None and self._counted_flops is None and self._counter is None:
            self._counter = flop_counter().__enter__()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counted_flops, self._counter = self._counter.get_total_flops(), None
        dp = data_shard(trainer).count
        module_flops = _flops_of(pl_module)
        # The module's figure is the whole model's per data-parallel batch; the counter saw this rank's share.
        self._flops += (
            module_flops * dp if module_flops is not None else (self._counted_flops or 0) * trainer.world_size
        )
        first = _first_tensor(batch)
        self._tokens += first.numel() * dp if first is not None else 0
        self._samples += first.shape[0] * dp if first is not None and first.dim() else 0
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch:
            self._step_done(trainer, pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._counter is not None:  # a fit that ended inside the counted micro-batch
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _step_done(self, trainer: Trainer, pl_module: LightningModule) -> None:
        now = _now(pl_module)
        elapsed = now - (self._step_start or now)
        if trainer.global_step > 1 and elapsed > 0:  # global_step counts the step just taken; skip the first
            self.history.append(self._rates(elapsed, trainer.world_size))
            self.totals.append((self._flops, self._tokens, self._samples))
            if trainer.global_step % (trainer.log_every_n_steps or 1) == 0:
                for logger in trainer.loggers:
                    logger.log_metrics(self.history[-1], step=trainer.global_step)
        self._step_start = now
        self._flops = self._tokens = self._samples = 0.0

    def _rates(self, elapsed: float, world_size: int) -> dict[str, float]:
        total_flops_per_s = self._flops / elapsed
        rates = {
            "throughput/tokens_per_s": self._tokens / elapsed,
            "throughput/samples_per_s": self._samples / elapsed,
            "throughput/tokens_per_s_per_rank": self._tokens / elapsed / world_size,
            "throughput/tflops_per_s": total_flops_per_s / 1e12,
            "throughput/tflops_per_s_per_rank": total_flops_per_s / world_size / 1e12,
        }
        if self.peak:
            rates["throughput/mfu"] = total_flops_per_s / (world_size * self.peak)
        return rates

    def mean(self, name: str) -> float:
        """Mean of a logged rate over the measured steps (``"mfu"``, ``"tokens_per_s"``, ...)."""
        values = [entry[f"throughput/{name}"] for entry in self.history if f"throughput/{name}" in entry]
        return sum(values) / len(values) if values else float("nan")


def _flops_of(module: LightningModule) -> int | None:
    value = getattr(module, "flops_per_batch", None)
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def _first_tensor(batch: Any) -> torch.Tensor | None:
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    if isinstance(first, dict):
        first = next(iter(first.values()), None)
    return first if isinstance(first, torch.Tensor) else None


def _now(module: LightningModule) -> float:
    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)  # kernels still queued belong to this step
    return time.perf_counter()
