"""What a strategy does to memory, as plain numbers: how each kind of state is split, and where it lives.

Read from a strategy *object* (or a registered name, built without starting anything), so the estimator, the
memory-chosen strategy and the profiler's report agree with what the strategy will really do.

Example:
    >>> layout_of("zero3", world_size=64)
    Layout(name='zero3', world_size=64, engine='deepspeed', shard_optimizer=True, shard_gradients=True, ...)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightscale.errors import ConfigurationError
from lightscale.parallel.mesh import ParallelDims

Engine = Literal["torch", "deepspeed"]
# DeepSpeed keeps whole (on every rank, beside the partition) each ZeRO-3 parameter this small.
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000


@dataclass(frozen=True)
class Layout:
    """How one rank holds the model: which states are sharded over ``dp_shard`` ranks, TP/PP splits, offload."""

    name: str
    world_size: int
    engine: Engine = "torch"
    shard_optimizer: bool = False
    shard_gradients: bool = False
    shard_parameters: bool = False
    dp_shard: int = 1
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # routed experts split over ep ranks; dense states then shard over dp_shard (= inner dp x ep)
    stages_per_rank: int = 1
    microbatches: int = 1
    v_shape: bool = False  # zbv places stages in a V (rank r holds r and 2 pp - 1 - r)
    offload_optimizer: bool = False  # optimizer state (and, with it, the sharded gradients) on the host
    offload_parameters: bool = False
    activation_checkpointing: str = "none"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    persistence_threshold: int = 0  # DeepSpeed ZeRO-3: parameters with at most this many elements stay whole

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def expert_shard(self) -> int:
        """Ranks that shard one ep rank's experts (FSDP over the inner data-parallel ranks)."""
        return max(1, self.dp_shard // self.ep)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this layout amounts to (0: nothing sharded)."""
        return 3 if self.shard_parameters else 2 if self.shard_gradients else 1 if self.shard_optimizer else 0

    def with_(self, **changes: Any) -> Layout:
        return replace(self, **changes)


def layout_of(strategy: str | Strategy, *, world_size: int) -> Layout:
    """The :class:`Layout` of a lightscale strategy (a registered name or an instance) on ``world_size`` ranks."""
    if isinstance(strategy, str):
        name = strategy
        strategy = _build(strategy)
    else:
        name = type(strategy).__name__
    kind = type(strategy).__name__
    readers = {
        "BucketedDDPStrategy": _ddp,
        "ZeroStrategy": _zero,
        "FSDP2Strategy": _fsdp2,
        "Parallel3DStrategy": _parallel_3d,
    }
    if kind == "FitMemoryStrategy":
        raise ConfigurationError(
            "fit_memory chooses its strategy when training starts: `lightscale plan` prints the candidates and its "
            "choice; estimate one of them by name (e.g. --trainer.strategy zero3)."
        )
    if kind not in readers:
        raise ConfigurationError(f"No memory layout for {kind}; lightscale estimates {', '.join(readers)}.")
    return readers[kind](strategy, name, world_size)


def _build(name: str) -> Strategy:
    from lightscale.strategies.registry import check_strategy, register_strategies

    register_strategies()
    check_strategy(name)
    if name not in StrategyRegistry:
        raise ConfigurationError(f"{name!r} is not a lightscale strategy; run `lightscale strategies` for the names.")
    entry = StrategyRegistry[name]
    return entry["strategy"](**entry["init_params"])


def _ddp(strategy: Any, name: str, world_size: int) -> Layout:
    return Layout(name, world_size, dp_replicate=world_size)


def _zero(strategy: Any, name: str, world_size: int) -> Layout:
    stage = strategy.options.stage
    zero = strategy.user_config.get("zero_optimization", {})
    threshold = zero.get("stage3_param_persistence_threshold", DEEPSPEED_PERSISTENCE_THRESHOLD)
    return Layout(
        name,
        world_size,
        engine="deepspeed",
        shard_optimizer=True,
        shard_gradients=stage >= 2,
        shard_parameters=stage == 3,
        dp_shard=world_size,
        offload_optimizer=strategy.options.offload_optimizer,
        offload_parameters=strategy.options.offload_params,
        persistence_threshold=threshold if stage == 3 else 0,
    )


def _fsdp2(strategy: Any, name: str, world_size: int) -> Layout:
    dims = ParallelDims(world_size=world_size, dp_replicate=strategy.dp_replicate, dp_shard=strategy.dp_shard)
    return Layout(
        name,
        world_size,
        shard_optimizer=True,
        shard_gradients=True,
        shard_parameters=True,
        dp_shard=dims.dp_shard,
        dp_replicate=dims.dp_replicate,
        offload_optimizer=strategy.offload,
        offload_parameters=strategy.offload,
        activation_checkpointing=strategy.activation_checkpointing,
    )


def _parallel_3d(strategy: Any, name: str, world_size: int) -> Layout:
    dims = strategy.parallel_dims(world_size)
    dense_shard = dims.dp_shard * dims.ep  # FSDP2 shards the dense part over the ep ranks too
    sharded = dense_shard > 1
    return Layout(
        name,
        world_size,
        shard_optimizer=sharded,
        shard_gradients=sharded,
        shard_parameters=sharded,
        dp_shard=dense_shard,
        dp_replicate=dims.dp_replicate,
        tp=dims.tp,
        pp=dims.pp,
        ep=dims.ep,
        stages_per_rank=strategy.stages_per_rank if dims.pp > 1 else 1,
        microbatches=strategy.microbatches,
        v_shape=strategy.schedule == "zbv",
        activation_checkpointing=strategy.activation_checkpointing,
        sequence_parallel=strategy.sequence_parallel and dims.tp > 1,
        loss_parallel=strategy.loss_parallel and dims.tp > 1,
    )
