"""``MemoryProfiler``: per rank and measured step, bytes of parameters, gradients, optimizer state and activations.

What is measured, and when (every ``every_n_steps`` optimizer steps; nothing in between):
    * gradients just before the optimizer step (their peak: ZeRO-2 partitions, FSDP shards, whole under DDP);
    * parameters and optimizer state after it (Adam's moments exist once it has run), each local shard only
      (lightscale/callbacks/measured_state.py: DTensor shards, DeepSpeed partitions, offloaded copies on the host);
    * activations: the peak bytes autograd saved during the step (lightscale/measure/saved_tensors.py), pipelines and
      gradient accumulation included; activation checkpointing's kept inputs too;
    * on CUDA, ``torch.cuda.max_memory_allocated`` of the step (``memory/peak``) and what it holds beyond the
      categories above (``memory/temporaries``: gathered parameters, buffers, workspaces); on CPU the tracked sum.

Logged as ``memory/<category>`` (the largest rank) and ``memory/rank<r>/<category>``; the estimate
(lightscale/estimate/) is logged once as ``memory/estimate/<category>`` and drawn beside the timeline in
``memory.png`` at the end of fit. On an out-of-memory error a report (largest live tensors, the estimate, what
other strategies would hold) is written before the error propagates.

Example:
    >>> Trainer(strategy="fsdp2", callbacks=[MemoryProfiler(every_n_steps=10)])
    $ lightscale fit --config gpt/small_fsdp2.yaml --trainer.callbacks+=lightscale.callbacks.MemoryProfiler
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightscale.callbacks.measured_state import ModelStateBytes, model_state_bytes
from lightscale.callbacks.memory_report import draw_timeline, estimate_for, write_oom_report
from lightscale.estimate.core import MemoryEstimate
from lightscale.measure.saved_tensors import SavedTensors, checkpointed_modules, count_checkpoint_inputs

log = logging.getLogger(__name__)
CATEGORIES = ("parameters", "gradients", "optimizer", "activations")


class MemoryProfiler(Callback):
    """Measures memory by category on every rank (see the module docstring).

    Args:
        every_n_steps: measure every this many optimizer steps (default: the Trainer's ``log_every_n_steps``).
        out_dir: where ``memory.png``, OOM reports and snapshots go (default: ``<log_dir>/memory``).
        plot: draw ``memory.png`` at the end of fit (needs matplotlib: ``pip install lightscale[plot]``).
        snapshot_steps: on CUDA, record the allocator history over these optimizer steps and dump a snapshot
            for https://pytorch.org/memory_viz (``snapshot_step<k>_rank<r>.pickle``).
        estimate: log and draw the estimator's figures beside the measurements.
    """

    def __init__(
        self,
        *,
        every_n_steps: int | None = None,
        out_dir: str | Path | None = None,
        plot: bool = True,
        snapshot_steps: Sequence[int] = (),
        estimate: bool = True,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.plot = plot
        self.snapshot_steps = set(snapshot_steps)
        self.with_estimate = estimate
        self.records: list[dict[str, float]] = []  # this rank's measurements, one per measured step
        self.all_ranks: list[list[dict[str, float]]] = []  # every rank's, gathered when logged
        self.estimate: MemoryEstimate | None = None
        self._saved: SavedTensors | None = None
        self._handles: list[RemovableHandle] = []
        self._gradients = 0
        self._gradients_host = 0

    # ---- when to measure --------------------------------------------------------------------------------------
    def _measuring(self, trainer: Trainer) -> bool:
        every = self.every_n_steps or trainer.log_every_n_steps or 1
        return trainer.global_step % every == 0 or trainer.global_step in self.snapshot_steps

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.out_dir is None:
            self.out_dir = Path(trainer.log_dir or trainer.default_root_dir) / "memory"

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.estimate is None and self.with_estimate:
            self.estimate = estimate_for(trainer, pl_module, batch)
        if self._saved is not None or not self._measuring(trainer):
            return  # a later micro-batch of a measured step: keep counting
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if torch.cuda.is_available() and trainer.global_step in self.snapshot_steps:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._saved = SavedTensors().__enter__()
        self._handles = count_checkpoint_inputs(checkpointed_modules(pl_module), self._saved)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._saved is not None:
            self._gradients = model_state_bytes(pl_module, trainer.optimizers, strategy=trainer.strategy).gradients
            self._gradients_host = _host(trainer, pl_module).gradients

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._saved is None or not _step_done(trainer, batch_idx):
            return
        saved, self._saved = self._saved, None
        saved.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        record = self._record(trainer, pl_module, saved)
        self.records.append(record)
        self._maybe_dump_snapshot(trainer)
        self._log(trainer, record)

    def _record(self, trainer: Trainer, pl_module: LightningModule, saved: SavedTensors) -> dict[str, float]:
        states = model_state_bytes(pl_module, trainer.optimizers, strategy=trainer.strategy)
        host = _host(trainer, pl_module)
        record = {
            "step": trainer.global_step,
            "parameters": states.parameters,
            "gradients": self._gradients,
            "optimizer": states.optimizer,
            "activations": saved.peak,
            "weight_copies": saved.weight_copies,
            "parameters_host": host.parameters,
            "gradients_host": self._gradients_host,
            "optimizer_host": host.optimizer,
        }
        tracked = sum(record[c] for c in CATEGORIES)
        record["peak"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else tracked
        # On CUDA the rest of the peak: gathered parameters, communication buffers, workspaces, recompute.
        record["temporaries"] = max(0, record["peak"] - tracked) if torch.cuda.is_available() else 0
        return record

    def _log(self, trainer: Trainer, record: dict[str, float]) -> None:
        per_rank = _gather(record)
        self.all_ranks.append(per_rank)
        logged = (*CATEGORIES, "temporaries", "peak")
        metrics = {f"memory/{c}": max(r[c] for r in per_rank) for c in logged}
        for rank, values in enumerate(per_rank):
            metrics |= {f"memory/rank{rank}/{c}": values[c] for c in logged}
        if self.estimate is not None and len(self.all_ranks) == 1:
            metrics |= {f"memory/estimate/{c}": getattr(self.estimate, c).total for c in CATEGORIES}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _maybe_dump_snapshot(self, trainer: Trainer) -> None:
        step = trainer.global_step - 1  # the step just taken
        if not torch.cuda.is_available() or step not in self.snapshot_steps:
            return
        assert self.out_dir is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.out_dir / f"snapshot_step{step}_rank{trainer.global_rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)

    # ---- end of fit and failures -----------------------------------------------------------------------------
    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop_counting()  # a fit that ended inside a measured step

    def _stop_counting(self) -> None:
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._saved = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self.plot and trainer.is_global_zero and self.all_ranks):
            return
        assert self.out_dir is not None
        path = draw_timeline(self.all_ranks, self.estimate, self.out_dir / "memory.png")
        if path is not None:
            rank_zero_info(f"lightscale: memory timeline written to {path}")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop_counting()
        if not is_out_of_memory(exception):
            return
        assert self.out_dir is not None
        path = self.out_dir / f"oom_rank{trainer.global_rank}.txt"
        try:
            write_oom_report(path, trainer, pl_module, exception, self.estimate)
        except Exception as failure:  # the report must never replace the user's error (Lightning re-raises it next)
            log.error("lightscale: out of memory; the report could not be written (%r)", failure)
            return
        log.error("lightscale: out of memory; report written to %s", path)


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or torch's host allocator failing (a RuntimeError)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def _host(trainer: Trainer, module: LightningModule) -> ModelStateBytes:
    # On a machine without CUDA every byte is host memory; "host" then means nothing more.
    if not torch.cuda.is_available():
        return ModelStateBytes(0, 0, 0)
    return model_state_bytes(module, trainer.optimizers, strategy=trainer.strategy, device_type="cpu")


def _step_done(trainer: Trainer, batch_idx: int) -> bool:
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch


def _gather(record: dict[str, float]) -> list[dict[str, float]]:
    if not dist.is_initialized():
        return [record]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    return gathered
