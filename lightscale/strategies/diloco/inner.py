"""A strategy inside a DiLoCo worker: the interface DiLoCo asks of the data parallelism among the worker's own ranks,
and the adapters that answer it for lightscale's ``FSDP2Strategy`` and ``BucketedDDPStrategy`` from their settings.

DiLoCo (strategies/diloco/) composes an inner strategy object - ``BucketedDDPStrategy(...)``, ``FSDP2Strategy(...)``
with any of their own settings (bucket sizes, bf16 or PowerSGD gradients, FSDP2's reduce dtype), or any object that
answers :class:`InnerStrategy` (checked with ``isinstance``; its settings by ``check_inner_settings``) - and keeps
only what is its own: the outer sync across workers, the optimizer-step wrap, its checkpoint extras. The inner object
is never connected to Lightning; DiLoCo asks the questions over the ``dp_shard`` axis of its mesh (a worker's ranks),
of the object itself when it answers :class:`InnerStrategy`, else of the adapter for its type
(:class:`FSDP2Worker`, :class:`BucketedDDPWorker`), which reads the strategy's public settings.

Example:
    >>> DiLoCoStrategy(workers=2, inner=BucketedDDPStrategy(compression="powersgd", bucket_cap_mb=5))
    >>> BucketedDDPWorker(BucketedDDPStrategy(bucket_cap_mb=5)).shards_parameters
    False
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol, runtime_checkable

from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed import ProcessGroup

from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.replica import refuse_ft_inside_diloco
from lightscale.optim.rule import ParameterView
from lightscale.parallel.activation_checkpoint import ACMode
from lightscale.parallel.data_parallel import BucketedGradReducer
from lightscale.parallel.fsdp import no_gradient_sync
from lightscale.parallel.parallelize import ParallelizeOptions
from lightscale.plugins.fsdp_precision import fsdp2_precision_plugin, mp_policy, precision_name
from lightscale.plugins.precision_contract import PrecisionRules, enforce_contract
from lightscale.strategies.ddp.strategy import BucketedDDPStrategy
from lightscale.strategies.fsdp2.strategy import FSDP2Strategy


@runtime_checkable
class InnerStrategy(Protocol):
    """What a strategy answers to run inside a DiLoCo worker."""

    precision_rules: PrecisionRules | None  # the worker's precision contract (inner_precision enforces it)

    @property
    def shards_parameters(self) -> bool:
        """Whether the worker's ranks each hold a shard (FSDP2) rather than the whole model (a reducer)."""
        ...

    def check_inner_settings(self) -> None:
        """Refuse (``ConfigurationError``) settings of this object that cannot run inside a worker."""
        ...

    def inner_precision(self, plugin: Precision, device_type: str) -> Precision:
        """The precision plugin the worker runs with, checked against this strategy's contract."""
        ...

    def inner_options(self, precision: str, *, activation_checkpointing: ACMode, compile: bool) -> ParallelizeOptions:
        """How the one parallelize path applies this strategy inside a worker (over the mesh's ``dp_shard``)."""
        ...

    def start_inner_sync(self, module: nn.Module, group: ProcessGroup | None) -> None:
        """After the model is placed: begin synchronizing gradients over ``group`` (None: a one-rank worker)."""
        ...

    def before_inner_step(self) -> None: ...

    def inner_no_sync(self, model: nn.Module | None) -> AbstractContextManager:
        """Entered on gradient-accumulation micro-steps."""
        ...

    def stop_inner_sync(self) -> None: ...

    def optimizer_parameter_view(self) -> ParameterView:
        """How the worker's optimizer sees its parameters: which shape-dependent optimizers run exactly
        (lightscale/optim/rule.py)."""
        ...


class FSDP2Worker:
    """An ``FSDP2Strategy``'s settings inside a DiLoCo worker: ``fully_shard`` over the worker's ranks."""

    shards_parameters = True

    def __init__(self, strategy: FSDP2Strategy) -> None:
        self.strategy = strategy
        self.precision_rules = strategy.precision_rules

    def check_inner_settings(self) -> None:
        strategy = self.strategy
        refuse_ft_inside_diloco(strategy.ft, "FSDP2Strategy")
        if strategy.offload or strategy.dp_replicate != 1:
            raise ConfigurationError(
                f"inner=FSDP2Strategy(offload={strategy.offload}, dp_replicate={strategy.dp_replicate}) cannot run "
                "inside a DiLoCo worker: a worker shards over its own ranks on the device (offload=False, "
                "dp_replicate=1); the workers are DiLoCo's replicas."
            )

    def inner_precision(self, plugin: Precision, device_type: str) -> Precision:
        name = precision_name(plugin)
        enforce_contract(self.precision_rules, name, device_type=device_type, compression=self.strategy.compression)
        return fsdp2_precision_plugin(name, device_type)

    def inner_options(self, precision: str, *, activation_checkpointing: ACMode, compile: bool) -> ParallelizeOptions:
        zeropp = self.strategy.zeropp
        if zeropp.secondary_shard is not None:
            raise ConfigurationError(
                f"secondary_shard={zeropp.secondary_shard!r} (hpZ) is not applied inside a DiLoCo worker; its "
                "quantized wires are (quantized_weights, quantized_gradients). Drop secondary_shard from inner=."
            )
        return ParallelizeOptions(
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            mp_policy=mp_policy(precision, self.strategy.compression),
            reshard_after_forward=self.strategy.reshard_after_forward,
            always_shard=True,
            fsdp_over="dp_shard",  # the workers meet through DiLoCo's outer sync, not through FSDP
            zeropp=zeropp if zeropp.enabled else None,  # over the worker's ranks
        )

    def start_inner_sync(self, module: nn.Module, group: ProcessGroup | None) -> None:
        """FSDP2's reduce-scatter is already on the worker's shards."""

    def before_inner_step(self) -> None:
        """Nothing: every rank of a worker holds shards of the same buffers' owner module."""

    def inner_no_sync(self, model: nn.Module | None) -> AbstractContextManager:
        return no_gradient_sync(model)

    def stop_inner_sync(self) -> None:
        """Nothing to release."""

    def optimizer_parameter_view(self) -> ParameterView:
        return self.strategy.optimizer_parameter_view()


class BucketedDDPWorker:
    """A ``BucketedDDPStrategy``'s settings inside a DiLoCo worker: its reducer over the worker's ranks (none for a
    one-rank worker), built from the strategy's bucket, compression and PowerSGD settings."""

    shards_parameters = False

    def __init__(self, strategy: BucketedDDPStrategy) -> None:
        self.strategy = strategy
        self.precision_rules = strategy.precision_rules
        self.reducer: BucketedGradReducer | None = None

    def check_inner_settings(self) -> None:
        """Every setting nests (the reducer runs over the worker's ranks) but ``fault_tolerant``, which DiLoCo
        would never run: its workers fail and heal through ``DiLoCoStrategy(fault_tolerant=...)``."""
        refuse_ft_inside_diloco(self.strategy.ft, "BucketedDDPStrategy")

    def inner_precision(self, plugin: Precision, device_type: str) -> Precision:
        enforce_contract(
            self.precision_rules, precision_name(plugin), device_type=device_type, compression=self.strategy.compression
        )
        return plugin

    def inner_options(self, precision: str, *, activation_checkpointing: ACMode, compile: bool) -> ParallelizeOptions:
        return ParallelizeOptions(activation_checkpointing=activation_checkpointing, compile=compile, fsdp_over="none")

    def start_inner_sync(self, module: nn.Module, group: ProcessGroup | None) -> None:
        if group is None:
            self.reducer = None
            return
        strategy = self.strategy
        self.reducer = BucketedGradReducer(
            module,
            process_group=group,
            bucket_cap_mb=strategy.bucket_cap_mb,
            first_bucket_cap_mb=strategy.first_bucket_cap_mb,
            compression=strategy.compression,
            find_unused_parameters=strategy.find_unused_parameters,
            powersgd_rank=strategy.powersgd_rank,
            powersgd_warmup_steps=strategy.powersgd_warmup_steps,
        )

    def before_inner_step(self) -> None:
        if self.reducer is not None:
            self.reducer.sync_buffers()  # like torch DDP's broadcast_buffers: every rank normalizes alike

    def inner_no_sync(self, model: nn.Module | None) -> AbstractContextManager:
        return self.reducer.no_sync() if self.reducer is not None else nullcontext()

    def stop_inner_sync(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None

    def optimizer_parameter_view(self) -> ParameterView:
        return self.strategy.optimizer_parameter_view()


# The adapter for each lightscale class that nests, picked by the inner object's type.
WORKER_ADAPTERS: dict[type, type[FSDP2Worker] | type[BucketedDDPWorker]] = {
    BucketedDDPStrategy: BucketedDDPWorker,
    FSDP2Strategy: FSDP2Worker,
}


def worker_adapter(inner: object) -> InnerStrategy | None:
    """``inner`` itself where it answers :class:`InnerStrategy` (a user's own), else the adapter for its type (an
    ``FSDP2Strategy``'s, a ``BucketedDDPStrategy``'s); None where neither (for the caller to refuse)."""
    if isinstance(inner, InnerStrategy):
        return inner
    for cls, adapter in WORKER_ADAPTERS.items():
        if isinstance(inner, cls):
            return adapter(inner)  # type: ignore[arg-type]  # the class the key names
    return None
