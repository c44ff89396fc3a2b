"""``diloco``, ``streaming_diloco``, ``local_sgd``: workers train alone for ``H`` optimizer steps, then meet.

A *worker* is a group of ranks running an inner data-parallel strategy (``bucketed_ddp``'s reducer or FSDP2 over
the worker's ranks); the layout is ``ParallelDims(dp_replicate=workers, dp_shard=ranks per worker)``. After every
``sync_every``-th optimizer step (Lightning's, so gradient accumulation counts steps, not micro-batches)
:class:`~lightscale.parallel.diloco.OuterSync` averages the pseudo-gradients (or, for ``local_sgd``, the parameters)
over the ``dp_replicate`` group of each shard position. Every rank reads its own data shard (dp = workers x inner).
Validation and checkpoints' ``model.*`` entries see the fp32 global model (lightscale/strategies/diloco/saved_state.py).
With ``fault_tolerant=`` the launch is one worker and :class:`~lightscale.parallel.diloco.FaultTolerantOuterSync`
meets the other launches through torchft: a worker may die, hang or rejoin without stopping the others (what that
adds to the strategy: lightscale/fault_tolerance/diloco_worker.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightscale.data.data_shard import DataShard
from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.fault_tolerance.diloco import FaultTolerantOuterSync
from lightscale.fault_tolerance.diloco_worker import (
    fault_tolerant_outer_sync,
    join_first_quorum,
    worker_data_shard,
    worker_fault_tolerance,
)
from lightscale.fault_tolerance.settings import FaultTolerance
from lightscale.optim.rule import ParameterView
from lightscale.parallel.activation_checkpoint import ACMode, check_ac_mode
from lightscale.parallel.contract import data_parallel_root, data_parallel_roots, manual_optimization, sharding_units
from lightscale.parallel.diloco import (
    OuterSync,
    Schedule,
    check_outer_settings,
    check_synchronous_steps,
    default_outer_step,
    sgd_outer_optimizer,
)
from lightscale.parallel.mesh import ParallelDims, axis
from lightscale.parallel.parallelize import apply_to_roots, built_on_meta, parallelize_model
from lightscale.plugins.fsdp_precision import precision_name
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.class_info import SEVERAL_OPTIMIZERS, init_arguments
from lightscale.strategies.ddp.strategy import BucketedDDPStrategy
from lightscale.strategies.diloco.checkpoint import DILOCO_WRITER, check_file_format
from lightscale.strategies.diloco.inner import InnerStrategy
from lightscale.strategies.diloco.workers import (
    DEFAULT_INNER,
    Inner,
    check_settings,
    diloco_layout,
    inner_parameter_view,
    inner_strategy,
    refuse_float8,
    shards_parameters,
    worker_dims,
)
from lightscale.strategies.fsdp2.strategy import FSDP2Strategy


class DiLoCoStrategy(LightscaleStrategy):
    """DiLoCo (Douillard et al. 2023), its streaming variant and local SGD, with data parallelism inside workers.

    Args:
        workers: replica groups that sync every ``sync_every`` steps; default one per node on several nodes, one
            per rank on one machine. Must divide the world size.
        inner: the data parallelism inside a worker: ``"bucketed_ddp"`` or ``"fsdp2"`` (with their defaults), a
            ``BucketedDDPStrategy(...)`` or ``FSDP2Strategy(...)`` whose settings (bucket sizes, bf16 or PowerSGD
            gradients, FSDP2's reduce dtype) the worker runs with (through its adapter), or any object that answers
            ``InnerStrategy``, a user's own (lightscale/strategies/diloco/inner.py).
        sync_every: ``H``, optimizer steps between two syncs (of each fragment).
        outer_lr, outer_momentum: the outer SGD (Nesterov when momentum > 0); ``None``: the default for
            ``sync_every`` (:func:`~lightscale.parallel.diloco.outer_sync.default_outer_step`, from the sweep in
            docs/benchmarks.md; the paper's 0.7 and 0.9 were tuned for H=500).
        fragments, overlap_steps: streaming DiLoCo: ``fragments`` staggered parts, each collective overlapped with
            ``overlap_steps`` inner steps.
        compression: the outer wire, ``"none"``, ``"bf16"`` or ``"int8"`` (diloco mode only).
        mode: ``"diloco"`` (outer optimizer on the mean pseudo-gradient) or ``"local_sgd"`` (mean of parameters).
        synchronous_steps: optimizer steps at the start run as synchronous data parallelism over every rank (each
            step's gradients averaged over the workers); the workers part after them. Early training is where
            training alone costs most (docs/benchmarks.md); the bytes of those steps are DDP's.
        activation_checkpointing, compile, meta_init: as for ``fsdp2``, applied inside each worker by the one
            parallelize path (lightscale/parallel/parallelize.py), whichever the inner strategy.
        fault_tolerant: ``True`` or a :class:`~lightscale.parallel.diloco.FaultTolerance`: this launch is *one*
            worker (its ranks run the inner strategy) that meets the others through torchft's lighthouse; a worker
            that dies or hangs drops out of its round, the others go on, and a restarted one heals from a live peer
            (the ``[ft]`` extra; docs/strategies/diloco.md).
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy` (``timeout_s``, ...).

    Example:
        >>> Trainer(strategy=DiLoCoStrategy(workers=4, sync_every=50, compression="int8"), devices=8)
    """

    # The default inner's rules, for the checks made before an instance exists (lightscale.Trainer's); a worker runs
    # its inner strategy's own contract (inner_precision).
    precision_rules = BucketedDDPStrategy.precision_rules
    aliases = {
        "diloco": ("DiLoCo: workers sync every H=100 steps, outer Nesterov SGD on the mean pseudo-gradient", {}),
        "streaming_diloco": (
            "DiLoCo in 4 staggered fragments, each sync overlapped with one inner step",
            {"fragments": 4, "overlap_steps": 1},
        ),
        "local_sgd": ("local SGD: workers average their parameters every H=100 steps", {"mode": "local_sgd"}),
    }
    plannable = ()
    parameter_view = "whole"  # the default inner's; inner="fsdp2" steps DTensor shards (parameter_view_for)
    reads_single_files = False
    checkpoint_formats = ("dcp", "file")  # "file": the global model (inner="bucketed_ddp": whole on every rank)
    checkpoint_writer = DILOCO_WRITER  # the workers' own state and the outer state beside the global model

    @classmethod
    @override
    def parameter_view_for(cls, init_params: dict[str, Any]) -> ParameterView:
        return inner_parameter_view(init_params.get("inner", DEFAULT_INNER))

    @override
    def optimizer_parameter_view(self) -> ParameterView:
        return self.inner.optimizer_parameter_view()  # the inner strategy's optimizer steps a worker's parameters

    @property
    @override
    def runs_stochastic_weight_averaging(self) -> bool:
        return not self.inner.shards_parameters  # each worker's whole replica under a reducer

    def __init__(
        self,
        *,
        workers: int | None = None,
        inner: Inner | BucketedDDPStrategy | FSDP2Strategy | InnerStrategy = DEFAULT_INNER,
        sync_every: int = 100,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        compression: str = "none",
        mode: str = "diloco",
        synchronous_steps: int = 0,
        activation_checkpointing: ACMode = "none",
        compile: bool = False,
        meta_init: bool = True,
        fault_tolerant: FaultTolerance | bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.schedule = Schedule(sync_every, fragments, overlap_steps)
        self.outer_step_defaulted = outer_lr is None or outer_momentum is None
        default_lr, default_momentum = default_outer_step(self.schedule.sync_every)
        outer_lr = default_lr if outer_lr is None else outer_lr
        outer_momentum = default_momentum if outer_momentum is None else outer_momentum
        check_settings(workers, outer_lr, outer_momentum)
        check_ac_mode(activation_checkpointing)
        inner = inner_strategy(inner)
        check_file_format(self.checkpointer.format, sharded=inner.shards_parameters)
        self.ft_settings = worker_fault_tolerance(fault_tolerant, workers, fragments, overlap_steps, compression)
        self.ft: FaultTolerantOuterSync | None = None  # built at setup from ft_settings (its .settings)
        check_synchronous_steps(synchronous_steps, fault_tolerant=self.ft_settings is not None)
        check_outer_settings(mode, compression)
        self.workers, self.mode, self.compression = workers, mode, compression
        # What the worker asks its questions of (an adapter, diloco/inner.py; a user's own InnerStrategy: itself).
        self.inner = inner
        self.synchronous_steps = synchronous_steps
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.activation_checkpointing, self.compile, self.meta_init = activation_checkpointing, compile, meta_init
        self._rng_state: dict[str, torch.Tensor] | None = None
        self.outer: OuterSync | None = None
        self._kept_locals: list[torch.Tensor] | None = None

    @override
    def memory_layout(self, world_size: int) -> Layout:
        """The inner layout inside a worker, plus the outer state (lightscale/strategies/diloco/workers.py)."""
        momentum = self.mode == "diloco" and self.outer_momentum > 0
        dims, sharded = self.parallel_dims(world_size), self.inner.shards_parameters
        return diloco_layout(
            type(self).__name__, dims, sharded, momentum, self.compression, self.activation_checkpointing
        )

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """As ``memory_layout`` answers, from the parameters (without a Trainer: one node)."""
        p = init_arguments(cls, init_params)
        momentum = p["outer_momentum"]
        momentum = default_outer_step(p["sync_every"])[1] if momentum is None else momentum
        dims = worker_dims(world_size, 1 if p["fault_tolerant"] is not False else p["workers"] or world_size)
        sharded, diloco_momentum = shards_parameters(p["inner"]), p["mode"] == "diloco" and momentum > 0
        return diloco_layout(
            cls.__name__, dims, sharded, diloco_momentum, p["compression"], p["activation_checkpointing"]
        )

    # ---- layout -------------------------------------------------------------------------------------------
    @override
    def parallel_dims(self, world_size: int) -> ParallelDims:
        workers = self.workers or (self.num_nodes if self.num_nodes > 1 else world_size)
        if self.ft_settings is not None:
            workers = 1  # this launch is one worker; the others are launches of their own
        return worker_dims(world_size, workers)

    @override
    def data_shard_of(self, dims: ParallelDims) -> DataShard:
        """Fault-tolerant workers with ``data_shards`` read their own part of the dataset, split over their ranks."""
        shard = super().data_shard_of(dims)
        return shard if self.ft_settings is None else worker_data_shard(self.ft_settings, shard)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """A fault-tolerant worker's first quorum runs here, before its data is read: a restarted worker heals from
        a live peer and its sampler (one with ``resume_from(epoch, batches)``, as lightscale's) reads on from the
        peers' step within the epoch."""
        loader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if self.ft is None or not trainer.training:
            return loader
        worker = axis(self.device_mesh, "dp_shard")
        replicas = worker.get_group() if worker.size() > 1 and not self.inner.shards_parameters else None
        join_first_quorum(self.ft, loader, trainer, model=self.model, replicas=replicas)
        return loader

    @property
    def worker(self) -> int:
        return self.global_rank // self.dims.dp_shard

    @property
    def shard(self) -> int:
        """This rank's position among its worker's shards (0 when the inner strategy replicates)."""
        return self.global_rank % self.dims.dp_shard if self.inner.shards_parameters else 0

    # ---- the model -----------------------------------------------------------------------------------------
    @contextmanager
    @override
    def model_sharded_context(self) -> Iterator[None]:  # type: ignore[override]
        """Modules built in ``configure_model`` land on the meta device, as under ``fsdp2``."""
        if not self.meta_init:
            yield
            return
        with built_on_meta() as self._rng_state:  # materialization replays init from here
            yield

    @override
    def configure_precision(self, plugin: Precision) -> Precision:
        refuse_float8(precision_name(plugin))  # reachable through lightning.Trainer, which skips the family check
        return self.inner.inner_precision(plugin, self.root_device.type)

    @override
    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        """Every rank starts from rank 0's weights; the one parallelize path inside a worker, OuterSync across."""
        sharded = self.inner.shards_parameters
        options = replace(
            self.inner.inner_options(
                precision_name(self.precision_plugin),
                activation_checkpointing=self.activation_checkpointing,
                compile=self.compile,
            ),
            root_reshard_after_forward=manual_optimization(module),
        )
        # Under manual optimization FSDP roots at each child network (lightscale/parallel/contract.py).
        roots = data_parallel_roots(module, strategy=type(self).__name__) if sharded else [data_parallel_root(module)]
        if sharded:
            self._roots = roots
        apply_to_roots(
            module,
            roots,
            sharding_units(module),
            lambda root, units: parallelize_model(root, self.device_mesh, units=units, options=options),
            device=self.root_device,
            rng_state=lambda: self.broadcast(self._rng_state),
        )
        worker = axis(self.device_mesh, "dp_shard")
        self.inner.start_inner_sync(module, worker.get_group() if worker.size() > 1 else None)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.outer, self.ft = self._outer_sync(module)
        return module

    def _outer_sync(self, module: nn.Module) -> tuple[OuterSync, FaultTolerantOuterSync | None]:
        """The OuterSync over the ``dp_replicate`` group that the settings ask for, or torchft's (with the
        :class:`~lightscale.parallel.diloco.FaultTolerantOuterSync` that holds it) when fault-tolerant."""
        outer_optimizer = self._outer_optimizer if self.mode == "diloco" else None
        schedule = self.schedule
        if outer_optimizer is not None:
            chosen = "the default for this H" if self.outer_step_defaulted else "as given"
            rank_zero_info(
                f"lightscale: DiLoCo outer step every {schedule.sync_every} steps: SGD lr {self.outer_lr}, "
                f"Nesterov momentum {self.outer_momentum} ({chosen}; docs/strategies/diloco.md)."
            )
        if self.ft_settings is not None:
            ft = fault_tolerant_outer_sync(
                self.ft_settings,
                module,
                sync_every=schedule.sync_every,
                mode=self.mode,
                outer_optimizer=outer_optimizer,
                world_size=self.world_size,
            )
            return ft.sync, ft
        outer = OuterSync(
            module.named_parameters(),
            sync_every=schedule.sync_every,
            group=axis(self.device_mesh, "dp_replicate").get_group(),
            mode=self.mode,
            outer_optimizer=outer_optimizer,
            fragments=schedule.fragments,
            overlap_steps=schedule.overlap_steps,
            compression=self.compression,
            broadcast_start=False,
            synchronous_steps=self.synchronous_steps,
        )
        return outer, None

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return sgd_outer_optimizer(self.outer_lr, self.outer_momentum)(params)

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and len(self.optimizers) != 1:
            raise ConfigurationError(
                f"{type(self).__name__} runs one inner optimizer per worker; configure_optimizers returned "
                f"{len(self.optimizers)}. {SEVERAL_OPTIMIZERS}"
            )

    @override
    def model_to_device(self) -> None:
        pass  # apply_parallelism places (or materializes) the model, after building on the meta device

    # ---- the step ------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.ft is not None:
            self.ft.before_inner_step()  # a round's first step waits for its quorum (and heals a worker behind)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.inner.before_inner_step()
        return super().training_step(*args, **kwargs)

    @override
    def gradient_sync_context(self) -> AbstractContextManager:
        return self.inner.inner_no_sync(self.model)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning calls this once per optimizer step (after accumulation): the outer step follows the inner one.
        A synchronous step averages the gradients over the workers inside the closure, before clipping sees them."""
        if self.outer is not None and self.outer.synchronous:
            closure = _averaging_gradients(closure, self.outer)
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.outer is not None:
            self.outer.after_inner_step(self.outer.step + 1)
        trainer = self.lightning_module.trainer
        if self.ft is not None and 0 < trainer.max_steps <= self.outer.step:
            trainer.should_stop = True  # a healed worker counts the peers' steps, not its own since its restart
        return result

    @override
    def on_train_end(self) -> None:
        if self.outer is not None:
            self.outer.flush()  # the final model includes the collectives still in flight
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        """Validation measures the global model (as DiLoCo reports); each worker's own parameters come back after."""
        super().on_validation_start()
        if self.outer is not None:  # each worker's own parameters, kept for on_validation_end
            self._kept_locals = [self.outer.local(i).clone() for i in range(len(self.outer.params))]
            with torch.no_grad():
                for i, (_, tensor) in enumerate(self.outer.named_globals()):
                    self.outer.local(i).copy_(tensor)

    @override
    def on_validation_end(self) -> None:
        if self.outer is not None and self._kept_locals is not None:
            with torch.no_grad():
                for i, tensor in enumerate(self._kept_locals):
                    self.outer.local(i).copy_(tensor)
            self._kept_locals = None
        super().on_validation_end()

    @override
    def teardown(self) -> None:
        self.inner.stop_inner_sync()
        if self.ft is not None:
            self.ft.shutdown()
            self.ft = None
        self.outer = None
        super().teardown()


def _averaging_gradients(closure: Any, outer: OuterSync) -> Any:
    """``closure`` followed by the average of the gradients over the workers (a synchronous step), before clipping."""

    def closure_then_average() -> Any:
        result = closure()
        outer.average_gradients()
        return result

    return closure_then_average
