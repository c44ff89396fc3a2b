"""What a DiLoCo worker is: the inner strategy its ranks run (a name, a lightscale strategy object under its adapter
or any object answering ``InnerStrategy``: diloco/inner.py), how workers divide the ranks, and what that holds in
memory.

Example:
    >>> worker_dims(8, 2)  # two workers of four ranks each
    ParallelDims(world_size=8, dp_replicate=2, dp_shard=4, ...)
"""

from __future__ import annotations

from typing import Literal

from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.optim.rule import ParameterView
from lightscale.parallel.activation_checkpoint import ACMode
from lightscale.parallel.mesh import ParallelDims
from lightscale.plugins.precision_contract import FLOAT8
from lightscale.strategies.ddp.strategy import BucketedDDPStrategy
from lightscale.strategies.diloco.inner import WORKER_ADAPTERS, InnerStrategy, worker_adapter
from lightscale.strategies.fsdp2.strategy import FSDP2Strategy

# inner= by name: the name each class that nests registers for its defaults (bucketed_ddp's, FSDP2's).
INNER_CLASSES: dict[str, type[BucketedDDPStrategy] | type[FSDP2Strategy]] = {
    cls.default_name(): cls for cls in (BucketedDDPStrategy, FSDP2Strategy)
}
INNERS: tuple[str, ...] = tuple(INNER_CLASSES)
DEFAULT_INNER = BucketedDDPStrategy.default_name()
Inner = Literal[INNERS]  # type: ignore[valid-type]  # the names, for jsonargparse


def inner_strategy(inner: Inner | InnerStrategy | BucketedDDPStrategy | FSDP2Strategy) -> InnerStrategy:
    """What the worker asks its questions of: a name builds the strategy with its defaults, under its adapter
    (diloco/inner.py); a ``BucketedDDPStrategy`` or ``FSDP2Strategy`` runs its own settings (bucket sizes, bf16 or
    PowerSGD gradients, FSDP2's reduce dtype) under its adapter; an object satisfying
    :class:`~lightscale.strategies.diloco.inner.InnerStrategy` is used as given; each after refusing the settings it
    says cannot nest."""
    if isinstance(inner, str) and inner in INNER_CLASSES:
        return WORKER_ADAPTERS[INNER_CLASSES[inner]](INNER_CLASSES[inner]())  # type: ignore[arg-type]
    worker = None if isinstance(inner, str) else worker_adapter(inner)
    if worker is None:
        raise ConfigurationError(
            f"inner={inner!r} cannot run inside a DiLoCo worker; choose one of {', '.join(INNERS)}, or a strategy "
            "object that answers lightscale.strategies.diloco.inner.InnerStrategy (BucketedDDPStrategy, FSDP2Strategy; "
            "engines that own the optimizer step, such as DeepSpeed's ZeRO, and tp/pp layouts do not nest)."
        )
    worker.check_inner_settings()
    return worker


def shards_parameters(inner: Inner | InnerStrategy | BucketedDDPStrategy | FSDP2Strategy) -> bool:
    """Whether the worker's ranks each hold a shard, asked of the adapter's class for a name (no instance built)."""
    if isinstance(inner, str):
        return WORKER_ADAPTERS[INNER_CLASSES[inner]].shards_parameters
    return _asked(inner).shards_parameters


def inner_parameter_view(inner: Inner | InnerStrategy | BucketedDDPStrategy | FSDP2Strategy) -> ParameterView:
    """How the worker's optimizer sees parameters, asked of the class for a name (no instance built)."""
    if isinstance(inner, str):
        return INNER_CLASSES[inner].parameter_view
    return _asked(inner).optimizer_parameter_view()


def _asked(inner: InnerStrategy | BucketedDDPStrategy | FSDP2Strategy) -> InnerStrategy:
    """What answers for ``inner`` before construction checks it (the estimator's questions): its adapter, or itself."""
    return worker_adapter(inner) or inner  # type: ignore[return-value]


def worker_dims(world_size: int, workers: int) -> ParallelDims:
    """``workers`` replicas (``dp_replicate``) of a worker's ranks (``dp_shard``); refused where they do not divide."""
    if world_size % workers:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigurationError(
            f"workers={workers} does not divide the world size {world_size}: every worker needs the same number "
            f"of ranks. Choose workers from {valid}."
        )
    return ParallelDims(world_size=world_size, dp_replicate=workers, dp_shard=world_size // workers)


def diloco_layout(name: str, dims: ParallelDims, sharded: bool, momentum: bool, compression: str, ac: ACMode) -> Layout:
    """The inner layout inside a worker, plus the outer state split like the parameters (fp32 each): the global
    copy, the outer momentum (``momentum``: diloco with momentum > 0) and the compression residual."""
    outer = 4 + 4 * momentum + 4 * (compression != "none")
    world_size = dims.world_size
    return Layout(
        name,
        world_size,
        shard_optimizer=sharded,
        shard_gradients=sharded,
        shard_parameters=sharded,
        dp_shard=dims.dp_shard if sharded else 1,
        dp_replicate=dims.dp_replicate if sharded else world_size,
        activation_checkpointing=ac,
        outer_state_bytes=outer,
    )


def check_settings(workers: int | None, outer_lr: float, outer_momentum: float) -> None:
    """Refuse, at construction, a number of workers or an outer step that cannot run."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ConfigurationError(f"workers={workers!r} is not valid; use a positive integer or None (one per node).")
    if not (isinstance(outer_lr, int | float) and outer_lr > 0):
        raise ConfigurationError(f"outer_lr={outer_lr!r} is not valid; it must be > 0 (None: the default for H).")
    if not (isinstance(outer_momentum, int | float) and 0 <= outer_momentum < 1):
        raise ConfigurationError(
            f"outer_momentum={outer_momentum!r} is not valid; use 0 <= momentum < 1 (None: the default for H)."
        )


def refuse_float8(precision: str) -> None:
    """Refuse a float8 precision: a worker's parameters are not converted to float8."""
    if precision in FLOAT8:
        raise ConfigurationError(
            f"precision={precision!r} cannot run under DiLoCo: its workers' parameters are not converted to float8. "
            "Use fsdp2 or parallel_3d for float8, or a DiLoCo precision such as 'bf16-mixed'."
        )
