"""What a strategy does to memory, as plain numbers: how each kind of state is split, and where it lives.

Each strategy class says it in its ``layout_for(world_size, **init_params)`` classmethod and an instance in its
``memory_layout(world_size)`` (:class:`DescribesMemory`); a registered name is answered by its class from
Lightning's ``StrategyRegistry`` (where lightscale's classes put themselves when defined), no instance built, so
the estimator, the memory-chosen strategy and the profiler's report agree with what the strategy will really do.
This module knows no strategy class: the dependency runs strategies -> estimate.

Example:
    >>> layout_of("zero3", world_size=64)
    Layout(name='zero3', world_size=64, engine='deepspeed', shard_optimizer=True, shard_gradients=True, ...)
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightscale.errors import ConfigurationError

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
    cp: int = 1  # sequences split over cp ranks (activations); dense states then shard over dp_shard (x cp)
    cp_mode: str = "ring"  # how attention crosses the cp ranks: what it saves for backward differs
    stages_per_rank: int = 1
    microbatches: int = 1
    v_shape: bool = False  # zbv places stages in a V (rank r holds r and 2 pp - 1 - r)
    offload_optimizer: bool = False  # optimizer state (and, with it, the sharded gradients) on the host
    offload_parameters: bool = False
    activation_checkpointing: str = "none"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    persistence_threshold: int = 0  # DeepSpeed ZeRO-3: parameters with at most this many elements stay whole
    secondary_shard: int = 1  # ZeRO++ hpZ: units keep their parameters over this many ranks from forward to backward
    # Bytes per parameter kept beside the inner model's states, split like the parameters (DiLoCo: the fp32 global
    # copy, the outer momentum, the compression residual); counted with the optimizer state.
    outer_state_bytes: int = 0

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @property
    def expert_shard(self) -> int:
        """Ranks that shard one ep rank's experts (FSDP over the inner data-parallel ranks, x cp)."""
        return max(1, self.dp_shard // self.ep)

    def with_(self, **changes: Any) -> Layout:
        return replace(self, **changes)


@runtime_checkable
class DescribesMemory(Protocol):
    """A strategy that can say how it holds the model on ``world_size`` ranks (every lightscale strategy)."""

    def memory_layout(self, world_size: int) -> Layout: ...


def layout_of(strategy: str | Strategy | Layout, *, world_size: int) -> Layout:
    """The :class:`Layout` of a strategy (a registered name or an instance) on ``world_size`` ranks."""
    if isinstance(strategy, Layout):
        return strategy
    if isinstance(strategy, str):
        return registered_layout(strategy, world_size).with_(name=strategy)
    if not isinstance(strategy, DescribesMemory):
        raise ConfigurationError(
            f"No memory layout for {type(strategy).__name__}: lightscale estimates strategies with a memory_layout "
            "method (run `lightscale strategies` for the names)."
        )
    return strategy.memory_layout(world_size)


def registered_layout(name: str, world_size: int) -> Layout:
    """The layout of the strategy registered as ``name``, read from its class (``layout_for``) and the registered
    init parameters: no instance is built where the class can answer alone, so a strategy whose engine is an extra
    (ZeRO: DeepSpeed) is described without it."""
    if name not in StrategyRegistry:
        closest = difflib.get_close_matches(name.lower(), StrategyRegistry.available_strategies(), n=1, cutoff=0.5)
        hint = f" Did you mean {closest[0]!r}?" if closest else ""
        raise ConfigurationError(f"Unknown strategy {name!r}.{hint} Run `lightscale strategies` for the names.")
    entry = StrategyRegistry[name]
    layout_for = getattr(entry["strategy"], "layout_for", None)
    if layout_for is None:
        raise ConfigurationError(f"{name!r} is not a lightscale strategy; run `lightscale strategies` for the names.")
    return layout_for(world_size, **entry["init_params"])
