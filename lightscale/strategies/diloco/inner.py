"""A strategy inside a DiLoCo worker: the data parallelism among the worker's own ranks, as the strategy itself does it.

DiLoCo (strategies/diloco/) composes an inner strategy object - ``BucketedDDPStrategy(...)``, ``FSDP2Strategy(...)``
with any of their own settings (bucket sizes, bf16 or PowerSGD gradients, FSDP2's reduce dtype), or any object that
answers :class:`InnerStrategy` (checked with ``isinstance``; its settings by ``check_inner_settings``) - and keeps
only what is its own: the outer sync across workers, the optimizer-step wrap, its checkpoint extras. The inner object
is never connected to Lightning; DiLoCo asks it these questions over the ``dp_shard`` axis of its mesh (a worker's
ranks).

Example:
    >>> DiLoCoStrategy(workers=2, inner=BucketedDDPStrategy(compression="powersgd", bucket_cap_mb=5))
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed import ProcessGroup

from lightscale.optim.rule import ParameterView
from lightscale.parallel.activation_checkpoint import ACMode
from lightscale.parallel.parallelize import ParallelizeOptions
from lightscale.plugins.precision_contract import PrecisionRules


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
