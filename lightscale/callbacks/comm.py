"""``CommMonitor``: elements and bytes per collective kind per optimizer step per rank, beside the theory.

Counting is lightscale/measure/comm_counter.py's ``CollectiveCounter`` (the exact-communication tests use it too): every
collective's whole buffer (all-reduced tensor, gathered output, scattered input, tensor sent). Logged as
``comm/<kind>_bytes`` and ``comm/<kind>_calls``, plus ``comm/traffic_per_rank_bytes``: what a ring moves per rank,
2(N-1)/N of an all-reduce's buffer and (N-1)/N of an all-gather's or reduce-scatter's. ``comm/theory/*`` is the
data-parallel theory for the strategy (Ψ = gradient bytes, N = data-parallel ranks): DDP and ZeRO-1/2 2Ψ(N-1)/N
per rank, ZeRO-3/FSDP 3Ψ(N-1)/N (parameters gathered in forward and again in backward); tensor- and pipeline-
parallel traffic comes on top (Megatron: 4·b·s·h per layer per microbatch; one activation per microbatch and
stage boundary).

Collectives of under ``min_bytes`` (the loop's metric syncs of a few scalars) are left out. The counter is a
``TorchDispatchMode`` active over measured steps only: do not measure the same steps with another dispatch mode
that is entered and left in a different callback order (Throughput's FlopCounterMode counts only the first
micro-batch, and only for modules without ``flops_per_batch``).

Example:
    >>> Trainer(strategy="fsdp2", callbacks=[CommMonitor(every_n_steps=10)])
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightscale.data.data_shard import data_shard
from lightscale.estimate.memory_layout import layout_of
from lightscale.estimate.model_states import bytes_per_parameter
from lightscale.estimate.parameters import rank_parameter_sizes
from lightscale.measure.comm_counter import CollectiveCounter, Traffic
from lightscale.strategies.shards import shards_of

RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}


class CommMonitor(Callback):
    """Measures collectives per optimizer step (see the module docstring).

    Args:
        every_n_steps: measure every this many optimizer steps (default: the Trainer's ``log_every_n_steps``).
        min_bytes: leave out collectives smaller than this.
    """

    def __init__(self, *, every_n_steps: int | None = None, min_bytes: int = 64) -> None:
        self.every_n_steps = every_n_steps
        self.min_bytes = min_bytes
        self.records: list[dict[str, Traffic]] = []  # per measured optimizer step, this rank
        self._counter: CollectiveCounter | None = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps or 1
        if self._counter is None and trainer.global_step % every == 0:
            self._counter = CollectiveCounter().__enter__()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        done = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch
        if self._counter is None or not done:
            return
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        totals = counter.totals(min_bytes=self.min_bytes)
        self.records.append(totals)
        self._log(trainer, pl_module, totals)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._counter is not None:  # a fit that ended inside a measured step
            self._counter.__exit__(None, None, None)
            self._counter = None

    def _log(self, trainer: Trainer, pl_module: LightningModule, totals: dict[str, Traffic]) -> None:
        n = data_shard(trainer).count  # the ranks with batches of their own
        metrics: dict[str, float] = {}
        for kind, traffic in totals.items():
            metrics |= {f"comm/{kind}_bytes": traffic.bytes, f"comm/{kind}_calls": traffic.calls}
        metrics["comm/traffic_per_rank_bytes"] = traffic_per_rank(totals, n)
        theory = data_parallel_theory(trainer, pl_module)
        if theory is not None:
            metrics["comm/theory/traffic_per_rank_bytes"] = theory * (n - 1) / n if n > 1 else 0.0
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def traffic_per_rank(totals: dict[str, Traffic], ranks: int) -> float:
    """Bytes a ring sends per rank for the counted data-parallel collectives."""
    if ranks <= 1:
        return 0.0
    return sum(RING_FACTOR.get(kind, 0.0) * t.bytes for kind, t in totals.items()) * (ranks - 1) / ranks


def data_parallel_theory(trainer: Trainer, module: LightningModule) -> float | None:
    """2Ψ (DDP, ZeRO-1/2) or 3Ψ (ZeRO-3, FSDP): buffer bytes a data-parallel step moves, Ψ = gradient bytes."""
    try:
        layout = layout_of(trainer.strategy, world_size=trainer.world_size)
        psi = sum(rank_parameter_sizes(module, layout, numel=shards_of(trainer.strategy).global_numel))
    except Exception:  # a theory line is a help; strategies it does not know get none
        return None
    grad_bytes = bytes_per_parameter(str(trainer.precision), engine=layout.engine).gradients
    return (3 if layout.shard_parameters else 2) * psi * grad_bytes
