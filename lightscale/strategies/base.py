"""The base every lightscale strategy shares, read top to bottom. It stands on ``ProcessStrategy``
(runtime/processes.py: Lightning's process interface: ranks, process group, timeout, failure watcher, collectives) and
owns what it hands work to: its ``checkpointer`` (strategies/checkpointer.py: the portable layout), its
``tensor_shards`` (strategies/shards.py: local shards, global shapes) and the precision plugin.

Here, in order: what a class declares (names, precision family, memory layout, checkpoint formats); the parallel layout
(:class:`ParallelDims`, a DeviceMesh on first use) with the data shard each rank reads and the check that ranks sharing
one got the same batch; the one setup template; Lightning's checkpoint entry points; the step methods; teardown.

What a subclass supplies (``setup`` and the four step methods are one template here; subclasses fill in hooks):
    * ``parallel_dims()`` (default: all data parallel), ``configure_precision(plugin)`` (checked against the precision
      contract), ``apply_parallelism(module)`` (wrap/shard/hook the single-device model), ``step_context(step)``;
    * optionally ``backward`` (a pipeline schedule ran it in ``training_step``) and ``optimizer_step`` (an engine such
      as DeepSpeed's owns step and accumulation); ``tensor_shards`` where its tensors differ from torch's defaults;
    * ``per_step_replica`` where ``fault_tolerant=`` makes this launch one torchft replica (bucketed_ddp, the FSDP2
      family): the base's hooks call it where one is set (fault_tolerance/replica.py), and are inert where not;
    * for checkpoints, handed to the one ``checkpointer``: ``checkpoint_states()`` (its own state as named ``Stateful``
      objects: bucketed_ddp's PowerSGD, fault tolerance), ``checkpoint_module()`` (what a rank holds: parallel_3d's
      stages) and ``checkpoint_writer`` (one object where writing itself differs: ZeRO's engine, DiLoCo's workers);
    * class data: ``aliases`` (registered in Lightning's ``StrategyRegistry`` when the class is defined, also in a
      user's file), ``precision_rules``, ``plannable``, ``layout_for(world_size, **init_params)`` (no instance).
See docs/architecture.md ("Adding a strategy") and the call path of one training step there.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightscale.data.batch_agreement import DEFAULT_EVERY, BatchAgreement, check_every
from lightscale.data.data_shard import DataShard, publish_data_shard
from lightscale.data.loader_position import maybe_track_trained_position
from lightscale.data.sampler import exactly_once_loader, position_in_epoch, seed_workers_by_data_shard
from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.estimate.plan import Plannable
from lightscale.fault_tolerance.replica import FaultTolerantReplica, SavedReplicaState, replica_data_shard
from lightscale.optim.install import install_exact_optimizers
from lightscale.optim.rule import ParameterView, check_optimizers
from lightscale.parallel.fsdp import reset_interrupted_roots
from lightscale.parallel.mesh import ParallelDims
from lightscale.patches.lightning import recreated_loaders_keep_their_arguments
from lightscale.plugins.precision_contract import PrecisionRules
from lightscale.runtime.processes import DEFAULT_TIMEOUT_S, ProcessStrategy
from lightscale.storage.safe_io import SafeCheckpointIO
from lightscale.strategies.checkpointer import PORTABLE, Checkpointer, PortableWriter
from lightscale.strategies.class_info import check_checkpoint_format, names_by_view, no_layout_error
from lightscale.strategies.registry import patch_lightning, register_class
from lightscale.strategies.shards import TensorShards
from lightscale.strategies.weight_averaging import adopt_weight_averaging, local_shards
from lightscale.strategies.weight_averaging import refuse_stochastic_weight_averaging as refuse_swa


class LightscaleStrategy(ProcessStrategy):
    """Base of lightscale strategies. Subclasses register ``aliases``: name -> (description, init kwargs).

    ``timeout_s`` bounds every collective (seconds). ``checkpoint_format`` (one of ``checkpoint_formats``) and
    ``async_save=True`` (write in the background): see :class:`~lightscale.strategies.checkpointer.Checkpointer`.

    ``check_batches_every``: ranks that share a data shard (tensor, context or pipeline parallel) must train on the
    same batch; their batches are compared at the first training step and every that many steps after
    (lightscale/data/batch_agreement.py), and a mismatch stops the run on every rank. ``None`` turns it off.
    """

    aliases: ClassVar[dict[str, tuple[str, dict[str, Any]]]] = {}
    # Its part of the precision contract, declared in its own module (lightscale/plugins/precision_contract.py).
    precision_rules: ClassVar[PrecisionRules | None] = None
    plannable: ClassVar[tuple[Plannable, ...]] = ()  # names the planner may choose (lightscale/estimate/plan.py)
    # Names an out-of-memory report proposes, with an activation-checkpointing mode (None: the name's own).
    memory_alternatives: ClassVar[tuple[tuple[str, str | None], ...]] = ()
    # How its optimizer sees parameters: which shape-dependent optimizers run exactly (lightscale/optim/rule.py).
    parameter_view: ClassVar[ParameterView] = "whole"
    # What ``checkpoint_format`` may name (the first is the default): "dcp" the portable layout, "file" Lightning's
    # single file (rank 0 writes it: whole parameters on every rank only), "deepspeed" DeepSpeed's own directory;
    # whether a single file (whole tensors, optimizer state by index) loads: into an unsharded model only.
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("dcp",)
    reads_single_files: ClassVar[bool] = True
    # Whether weights copied into the model after setup are the ones trained; False where an engine builds its own
    # fp32 master copies at setup (ZeRO). InitWeights (callbacks/init_weights.py) refuses strategies without it.
    weights_settable_after_setup: ClassVar[bool] = True
    # The one object that writes and reads its checkpoints (strategies/checkpointer.py): the portable layout unless its
    # family writes otherwise (ZeRO's engine, DiLoCo's workers); ``async_save`` runs in the portable one only.
    checkpoint_writer: ClassVar[PortableWriter] = PORTABLE
    tensor_shards: ClassVar[TensorShards] = TensorShards()  # its answers about the tensors it holds (shards.py)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class that declares ``aliases`` in its own body registers them when defined (in a user's file too)."""
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("aliases"):
            register_class(cls)

    def checkpoint_states(self) -> dict[str, Stateful]:
        """The family's own state handed to the one checkpointer by name (torchft's count, PowerSGD's residuals,
        DiLoCo's outer state, ...): each ``state_dict()`` is saved in the checkpoint's ``lightscale`` entry under its
        name (collective: every rank calls it), and a resumed fit gives it back with ``load_state_dict`` where the
        checkpoint holds that name. The checkpointer never reads a family's fields; this is all it asks."""
        replica = self.per_step_replica
        return {} if replica is None else {"fault_tolerance": SavedReplicaState(replica)}

    def checkpoint_module(self) -> nn.Module:
        """The module whose state this rank's checkpoints hold, under the LightningModule's own parameter names (the
        checkpointer asks it at each save and load); parallel_3d answers with this rank's pipeline stages."""
        return self.lightning_module

    def memory_layout(self, world_size: int) -> Layout:
        """How one rank holds the model on ``world_size`` ranks (estimate/memory_layout.py); each family says."""
        return type(self).layout_for(world_size)

    @classmethod
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """How a strategy built with ``init_params`` would hold the model (estimator, planner), from the class and
        the parameters (``init_arguments``): no instance, so no patch installed nor engine needed. Each family says."""
        raise no_layout_error(cls, LightscaleStrategy.layout_for.__func__)  # type: ignore[attr-defined]

    @classmethod
    def default_name(cls) -> str:
        """The name this class registers for itself with its defaults (its ``aliases`` entry without init kwargs)."""
        for name, (_, init_params) in cls.__dict__.get("aliases", {}).items():
            if not init_params:
                return name
        raise ConfigurationError(f"{cls.__name__} registers no name for its default settings.")

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        async_save: bool = False,
        checkpoint_format: str = "dcp",
        check_batches_every: int | None = DEFAULT_EVERY,
    ) -> None:
        patch_lightning()  # lightscale's Lightning side is in use: its global patches, once (registry.py)
        check_checkpoint_format(type(self), checkpoint_format)
        check_every(check_batches_every)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or SafeCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout_s=timeout_s,
        )
        self.checkpointer = Checkpointer(self, checkpoint_format=checkpoint_format, async_save=async_save)
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        self._roots: list[nn.Module] = []  # where FSDP roots: the LightningModule among them makes steps go through it
        self.check_batches_every = check_batches_every
        self._batch_agreement: BatchAgreement | None = None  # with the layout, at setup_environment

    # ---- layout ---------------------------------------------------------------------------------------------
    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The layout of this strategy for ``world_size`` ranks; the default is pure data parallelism."""
        return ParallelDims(world_size=world_size, dp_replicate=-1)

    @property
    def dims(self) -> ParallelDims:
        if self._dims is None:
            self._dims = self.parallel_dims(self.world_size)
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The named DeviceMesh of :attr:`dims`, built on first use (it creates process sub-groups)."""
        if self._mesh is None:
            self._mesh = self.dims.build_mesh(self.root_device.type)
        return self._mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        shard = self.data_shard_of(self.dims)  # ranks sharing a batch (tp, cp, pp) share a data shard
        return {"num_replicas": shard.count, "rank": shard.index}

    def data_shard_of(self, dims: ParallelDims) -> DataShard:
        """This rank's data shard under ``dims``: the one answer the sampler and ``lightscale.data_shard()`` give (with
        ``data_shards``, a fault-tolerant replica reads its own part of the dataset, split over its ranks)."""
        shard = DataShard(dims.data_rank(self.global_rank), dims.data_shards)
        replica = self.per_step_replica
        return shard if replica is None else replica_data_shard(replica.settings, shard)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's padding ``DistributedSampler`` becomes an ``ExactlyOnceSampler`` (data/sampler.py): every
        sample once per epoch per data-parallel group, resumed mid-epoch where the checkpoint left off; its workers
        seeded by the data shard, so ranks sharing one draw the same augmentations; a stateful stream saves the
        position of the batches trained (data/loader_position.py)."""
        trainer = self.lightning_module.trainer
        kwargs, training = self.distributed_sampler_kwargs, trainer.training
        drop, position = training and not self.trains_short_batches, position_in_epoch(trainer)
        loader = exactly_once_loader(dataloader, **kwargs, training=training, drop_remainder=drop, position=position)
        seed_workers_by_data_shard(loader, kwargs["rank"])
        # A stream's saved position: the batches trained, not Lightning's look-ahead (data/loader_position.py).
        loader = maybe_track_trained_position(loader, training=training)
        replica = self.per_step_replica
        if replica is not None and training:
            replica.join(trainer, loader)  # before the data is read: a replica behind heals and reads on from there
        return loader

    @property
    def runs_stochastic_weight_averaging(self) -> bool:
        """Whether Lightning's ``StochasticWeightAveraging`` callback runs: every rank holds whole plain parameters
        and steps them with a torch optimizer (else it is refused before training, naming ``WeightAveraging``)."""
        return False

    @property
    def trains_short_batches(self) -> bool:
        """Whether a training batch may be smaller than the others (an epoch's last); a pipeline runs one shape."""
        return True

    def check_before_launch(self, trainer: Trainer) -> None:
        """Refuse settings that only the Trainer knows (clipping, precision, where checkpoints go), before any rank
        starts or connects."""
        self.checkpointer.check_locations(trainer)

    @override
    def set_world_ranks(self) -> None:
        """Ranks, then this rank's data shard published for ``lightscale.data_shard()`` (and DataLoader workers): the
        Trainer's constructor calls this, so a dataset built before ``fit`` reads its shard too."""
        super().set_world_ranks()
        with suppress(ConfigurationError):  # a layout that does not fit is refused by setup_environment
            shard = self.data_shard_of(self.parallel_dims(self.world_size))
            publish_data_shard(shard, rank=self.global_rank, world_size=self.world_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._dims = self.parallel_dims(self.world_size)  # validate the layout before any model work
        self._batch_agreement = BatchAgreement(self._dims, every=self.check_batches_every)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:  # a user's DataLoader subclass re-created twice: Lightning's sampler, then ours
            recreated_loaders_keep_their_arguments(trainer)
            runs_it = self.runs_stochastic_weight_averaging
            refuse_swa(trainer, type(self).__name__, runs_it=runs_it)
        if trainer is not None:
            self.checkpointer.check_callback_dirs(trainer)

    # ---- the model ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer) -> None:
        """The one setup template: precision plugin, parallelism applied from outside, optimizers (when fitting)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin = self.configure_precision(self.precision_plugin)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and self._layer_sync:  # sync_batchnorm=True
            self.model = self._layer_sync.apply(self.model)
        # Evaluation runs the parallelized model too (sharded, pipelined), after fit and in a fresh process alike.
        self.model = self.apply_parallelism(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            self.check_optimizers(self.optimizers)  # before the first step: exact as one process, or refused
            view = self.optimizer_parameter_view()  # e.g. torch's Adafactor stepped on DTensor shards
            self.optimizers = install_exact_optimizers(self.optimizers, self.lr_scheduler_configs, view)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            adopt_weight_averaging(trainer, self.lightning_module)
        self.barrier()  # no rank starts a step (its collectives) before every rank's model is ready

    def local_shards(self, module: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The pieces of ``module``'s (default: the LightningModule's) parameters and buffers this rank holds, by name:
        writable aliases of the live weights, for elementwise work such as an EMA (strategies/weight_averaging.py)."""
        return local_shards(module if module is not None else self.lightning_module, self.tensor_shards)

    # ---- checkpoints: Lightning's entry points, handed to the Checkpointer (strategies/checkpointer.py) ------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the layout loads into the parallelized model and its optimizers, which setup creates

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.checkpointer.save(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpointer.load(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self.checkpointer.load_model_state_dict(checkpoint, strict=strict)

    # ---- optimizers ----------------------------------------------------------------------------------------
    @classmethod
    def parameter_view_for(cls, init_params: dict[str, Any]) -> ParameterView:
        """How the optimizer sees parameters under an alias with ``init_params`` (DiLoCo's depends on ``inner``)."""
        return cls.parameter_view

    def optimizer_parameter_view(self) -> ParameterView:
        """How this instance's optimizer sees parameters."""
        return type(self).parameter_view

    def check_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Refuse an optimizer whose step reads a parameter's shape where this strategy would change its math
        (lightscale/optim/rule.py); the error names the strategy names under which it runs exactly."""
        view = self.optimizer_parameter_view()
        check_optimizers(optimizers, view=view, strategy=type(self).__name__, names_by_view=names_by_view)

    def configure_precision(self, plugin: Precision) -> Precision:
        """The precision plugin this strategy runs with (checked against its column of the precision contract)."""
        return plugin

    # ---- the step: Lightning's four step methods, one template ---------------------------------------------
    def step_context(self, step: str) -> AbstractContextManager:
        """Entered around each step (``"training_step"``, ...), outside the precision plugin's context."""
        return nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context("training_step"), self.precision_plugin.train_step_context():
            return self.call_step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context("validation_step"), self.precision_plugin.val_step_context():
            return self.call_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context("test_step"), self.precision_plugin.test_step_context():
            return self.call_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.step_context("predict_step"), self.precision_plugin.predict_step_context():
            return self.call_step("predict_step", *args, **kwargs)

    def call_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's ``step``: through a wrapper's forward (DeepSpeed's engine), or through the
        module's own ``__call__`` when FSDP roots at it (its hooks gather the parameters); Lightning's forward
        redirection does both. Under manual optimization FSDP never roots at it (``data_parallel_roots``)."""
        module = self.lightning_module
        assert module is not None and self.model is not None
        if self.model is not module:
            return self._forward_redirection(self.model, module, step, *args, **kwargs)
        if any(root is module for root in self._roots):
            return self._forward_redirection(module, module, step, *args, **kwargs)
        return getattr(module, step)(*args, **kwargs)

    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        """Parallelize the single-device ``module`` for training, in place or by wrapping; return the result."""
        return module

    def gradient_sync_context(self) -> AbstractContextManager:
        """Context in which backward accumulates locally (a gradient-accumulation micro-step)."""
        return nullcontext()

    @override
    def block_backward_sync(self) -> AbstractContextManager:
        return self.gradient_sync_context()

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Lightning's step (the precision plugin's, which steps the optimizer); a fault-tolerant replica runs the
        closure (forward, backward), averages over the step's replicas and applies the step only if all succeeded."""
        replica = self.per_step_replica
        if replica is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        step = super().optimizer_step
        return replica.optimizer_step(lambda ran: step(optimizer, ran, model, **kwargs), closure)

    @property
    def per_step_replica(self) -> FaultTolerantReplica | None:
        """This launch's torchft replica where ``fault_tolerant=`` makes it one (bucketed_ddp, the FSDP2 family;
        not DiLoCo's per-round workers), called from the hooks here: its data part, the first quorum, one quorum per
        batch, the gated optimizer step, its checkpointed state, its shutdown. ``None`` (the default): no fault
        tolerance, and those hooks are Lightning's and lightscale's alone."""
        return None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first batch after a load draws from the saved random states; ranks sharing a data shard compare the
        batch on checked steps (collective)."""
        self.checkpointer.restore_random_states()
        super().on_train_batch_start(batch, batch_idx)
        if self._batch_agreement is not None:
            self._batch_agreement.maybe_check(batch, device=self.root_device)
        replica = self.per_step_replica
        if replica is not None:
            replica.begin(self.lightning_module.trainer, batch_idx)  # this batch's quorum

    # ---- registry and teardown -----------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (description, init_params) in cls.__dict__.get("aliases", {}).items():  # not the parent's
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

    @override
    def teardown(self) -> None:
        replica = self.per_step_replica
        if replica is not None:
            replica.finish()
        self.checkpointer.wait()  # the last save of fit is published before fit returns
        lightning_module = self.lightning_module
        if lightning_module is not None:
            trainer = lightning_module._trainer
            if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
                reset_interrupted_roots(self._roots)
            self.model = lightning_module  # drop wrappers; hooks are removed by the subclass
            if self._layer_sync and lightning_module._trainer is not None:
                self.model = self._layer_sync.revert(self.model)
        super().teardown()
