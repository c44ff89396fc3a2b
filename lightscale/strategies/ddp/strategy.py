"""``bucketed_ddp``: lightscale's own data parallelism, written on ``torch.distributed`` collectives.

The model is not wrapped: :class:`~lightscale.parallel.BucketedGradReducer` hooks its parameters, so
``self.model`` stays the user's LightningModule. Checkpoints are the portable layout of every lightscale strategy
(whole tensors, written once; see ``LightscaleStrategy.save_checkpoint``); single-file ``.ckpt`` still load.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch.distributed import ProcessGroup
from typing_extensions import override

from lightscale.estimate.memory_layout import Layout
from lightscale.estimate.plan import Plannable
from lightscale.fault_tolerance.replica import (
    FaultTolerantReplica,
    replica_fault_tolerance,
)
from lightscale.fault_tolerance.settings import FaultTolerance
from lightscale.parallel.data_parallel import BucketedGradReducer, Compression, validate_reducer_settings
from lightscale.parallel.powersgd import EveryRankState, validate_powersgd
from lightscale.plugins.fsdp_precision import precision_name
from lightscale.plugins.precision_contract import PrecisionRules, enforce_contract, float8_refused
from lightscale.strategies.base import LightscaleStrategy


class BucketedDDPStrategy(LightscaleStrategy):
    """Data parallel training with bucketed, backward-overlapped gradient all-reduce.

    Args:
        bucket_cap_mb: bucket size in MiB (25 like torch DDP).
        first_bucket_cap_mb: the first bucket (last layers) is small so communication starts early.
        compression: ``"none"``, ``"bf16"`` or ``"fp16"`` on the wire, or ``"powersgd"``: low-rank factors of
            each gradient matrix with error feedback (docs/strategies/bucketed_ddp.md, "PowerSGD").
        find_unused_parameters: reduce zeros for parameters that get no gradient instead of raising.
        powersgd_rank: rank r of PowerSGD's factors: a matrix n x m sends (n + m) r numbers instead of n m.
        powersgd_warmup_steps: optimizer steps reduced uncompressed before PowerSGD starts.
        fault_tolerant: a :class:`~lightscale.FaultTolerance` (or ``True``: its defaults): this launch is one
            replica; replicas meet at a torchft lighthouse every step, may die and rejoin while the others train on
            (docs/fault_tolerance.md).
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy` (``timeout_s``, ...).

    Example:
        >>> Trainer(strategy=BucketedDDPStrategy(bucket_cap_mb=50, compression="bf16"), devices=4)
    """

    # The standard meaning of every precision (autocast, GradScaler); PowerSGD needs a reducer that sees whole gradient
    # matrices, so only this family implements it.
    precision_rules = PrecisionRules(
        "bucketed_ddp",
        refused=float8_refused(
            "float8 is applied on the one parallelize path of fsdp2 and parallel_3d (fsdp2 also runs on one device)"
        ),
        compressions={"powersgd": "bucketed_ddp_powersgd"},
    )
    checkpoint_formats = ("dcp", "file")  # whole parameters on every rank: Lightning's single file too
    aliases = {
        "bucketed_ddp": ("lightscale's bucketed DDP: overlapped all-reduce, 25 MiB buckets", {}),
        "bucketed_ddp_bf16": ("bucketed_ddp with gradients sent as bf16 (half the bytes)", {"compression": "bf16"}),
        "bucketed_ddp_powersgd": (
            "bucketed_ddp with PowerSGD: rank-4 factors of each gradient matrix, error feedback",
            {"compression": "powersgd"},
        ),
    }
    plannable = (Plannable("bucketed_ddp", "2Ψ", "replicated states, one all-reduce of the gradients"),)

    @property
    @override
    def runs_stochastic_weight_averaging(self) -> bool:
        return True  # whole parameters, the user's torch optimizer

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """Every state replicated on every rank."""
        return Layout(cls.__name__, world_size, dp_replicate=world_size)

    def __init__(
        self,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        compression: Compression = "none",
        find_unused_parameters: bool = False,
        powersgd_rank: int = 4,
        powersgd_warmup_steps: int = 0,
        fault_tolerant: FaultTolerance | bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        ft = replica_fault_tolerance(
            fault_tolerant, compression=compression, find_unused_parameters=find_unused_parameters
        )
        validate_reducer_settings(bucket_cap_mb, first_bucket_cap_mb, compression)
        validate_powersgd(powersgd_rank, powersgd_warmup_steps)
        self.powersgd_rank = powersgd_rank
        self.powersgd_warmup_steps = powersgd_warmup_steps
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.compression = compression
        self.find_unused_parameters = find_unused_parameters
        self.reducer: BucketedGradReducer | None = None
        self.ft = FaultTolerantReplica(ft) if ft is not None else None  # its settings: self.ft.settings

    @property
    @override
    def per_step_replica(self) -> FaultTolerantReplica | None:
        return self.ft  # with fault_tolerant=: this launch, one replica

    @override
    def configure_precision(self, plugin: Precision) -> Precision:
        name = precision_name(plugin)
        enforce_contract(self.precision_rules, name, device_type=self.root_device.type, compression=self.compression)
        return plugin

    @override
    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        self.reducer = self._reducer(module, group=None)
        if self.ft is not None:  # each bucket, once averaged over this replica's ranks, across replicas
            self.reducer.after_reduce = self.ft.launch
        return module

    def _reducer(self, module: nn.Module, *, group: ProcessGroup | None) -> BucketedGradReducer:
        return BucketedGradReducer(
            module,
            process_group=group,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_cap_mb=self.first_bucket_cap_mb,
            compression=self.compression,
            find_unused_parameters=self.find_unused_parameters,
            powersgd_rank=self.powersgd_rank,
            powersgd_warmup_steps=self.powersgd_warmup_steps,
        )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.reducer is not None:
            self.reducer.sync_buffers()  # like torch DDP's broadcast_buffers: every rank normalizes alike
        return super().training_step(*args, **kwargs)

    @override
    def gradient_sync_context(self) -> AbstractContextManager:
        return self.reducer.no_sync() if self.reducer is not None else nullcontext()

    @override
    def checkpoint_states(self) -> dict[str, Any]:
        """Every rank's PowerSGD state (step, Qs, its own residuals) when it compresses, beside torchft's."""
        states = super().checkpoint_states()
        powersgd = self.reducer.powersgd if self.reducer is not None else None
        if powersgd is not None:
            states["powersgd"] = EveryRankState(powersgd)
        return states

    @override
    def teardown(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        super().teardown()
