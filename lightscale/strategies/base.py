"""The base every lightscale strategy shares, on Lightning's ``ParallelStrategy``.

What it owns: the process group (gloo on CPU, nccl on CUDA, a collective timeout so hangs fail fast), the
parallel layout (:class:`ParallelDims`, turned into a DeviceMesh on first use), the precision and checkpoint
plugins, applying parallelism to the model from outside it, checkpoints in the one portable layout
(lightscale/checkpoint/layout.py: any strategy's, at any world size), and teardown.

What a subclass supplies (``setup`` and the four step methods are one template here; subclasses fill in hooks):
    * ``parallel_dims()`` - the layout for this world size (default: all data parallel);
    * ``configure_precision(plugin)`` - the precision plugin it runs with, checked against the precision contract;
    * ``apply_parallelism(module)`` - wrap/shard/hook the single-device model for training;
    * ``step_context(step)`` - entered around every step (loss parallelism, serving a pipeline);
    * optionally, taking over the step: ``backward`` (a pipeline schedule has already run backward in
      ``training_step``) and ``optimizer_step`` (an engine such as DeepSpeed's owns step and accumulation);
    * ``aliases`` - the names it registers in Lightning's ``StrategyRegistry`` (and lightscale's list of classes)
      when the class is defined, also in a user's own file;
    * ``precision_family`` - its column of the precision contract; ``plannable`` - which names ``fit_memory`` /
      ``lightscale plan`` may choose; ``memory_layout(world_size)`` - how it holds the model, for the estimator.
See docs/architecture.md ("Adding a strategy") and the call path of one training step there.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightscale.checkpoint.async_save import AsyncCheckpointWriter
from lightscale.checkpoint.layout import TRAINER_STATE, load_sharded, save_sharded, saved_rng_states, trainer_state_of
from lightscale.checkpoint.rng import restore_rng_states
from lightscale.checkpoint.safe_io import SafeCheckpointIO
from lightscale.checkpoint.shape_check import check_state_dict_shapes
from lightscale.checkpoint.shared_dir import check_shared_dir
from lightscale.errors import ConfigurationError
from lightscale.estimate.layout import Layout
from lightscale.estimate.plan import Plannable
from lightscale.parallel.mesh import ParallelDims
from lightscale.plugins.precision_contract import Family, check_family
from lightscale.strategies.failure import announce_failure, watch_for_failures
from lightscale.strategies.flight_recorder import maybe_enable_flight_recorder
from lightscale.strategies.launch import Launcher, exit_with_launcher, restart_safe_store
from lightscale.strategies.sampler import exactly_once_loader, position_in_epoch

log = logging.getLogger(__name__)
# Every strategy class that declares aliases, in the order they were defined (lightscale/strategies/registry.py).
REGISTERED: list[type[LightscaleStrategy]] = []

# A collective that waits this long is a hang: errors reach every rank through the failure watcher within seconds,
# and the slow single-rank phases (prepare_data) wait at Lightning's own barrier, which has no timeout. Ten
# minutes is torch's NCCL default and covers a first-step compile or a large checkpoint write; raise it with
# ``timeout_s`` for slower ones.
DEFAULT_TIMEOUT_S = 600.0


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class LightscaleStrategy(ParallelStrategy):
    """Base of lightscale strategies. Subclasses register ``aliases``: name -> (description, init kwargs).

    ``async_save=True`` writes checkpoints in the background (training blocks only while the state is copied to
    CPU memory; lightscale/checkpoint/async_save.py), on strategies that save through this class's
    ``save_checkpoint`` (the portable layout).
    """

    aliases: ClassVar[dict[str, tuple[str, dict[str, Any]]]] = {}
    precision_family: ClassVar[Family | None] = None  # its column of the precision contract (precision_contract.py)
    plannable: ClassVar[tuple[Plannable, ...]] = ()  # names the planner may choose (lightscale/estimate/plan.py)
    # Whether a single-file Lightning checkpoint (whole tensors, optimizer state by index) loads: only into an
    # unsharded model; sharded strategies read the layout alone.
    reads_single_files: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class that declares ``aliases`` in its own body registers them when defined (in a user's file too)."""
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("aliases"):
            if cls.precision_family is not None:
                check_family(cls.precision_family)
            own = set(cls.__dict__["aliases"])
            REGISTERED[:] = [known for known in REGISTERED if not own & set(known.__dict__["aliases"])]
            REGISTERED.append(cls)
            cls.register_strategies(StrategyRegistry)

    def memory_layout(self, world_size: int) -> Layout:
        """How one rank holds the model on ``world_size`` ranks (lightscale/estimate/layout.py); each family says."""
        described = [
            known.__name__ for known in REGISTERED if known.memory_layout is not LightscaleStrategy.memory_layout
        ]
        raise ConfigurationError(
            f"No memory layout for {type(self).__name__}; lightscale estimates {', '.join(described)}."
        )

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
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or SafeCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        if not timeout_s > 0:
            raise ConfigurationError(
                f"timeout_s={timeout_s!r} is not valid: the collective timeout must be positive seconds."
            )
        self._num_nodes = 1
        self._backend = process_group_backend
        self._timeout = timedelta(seconds=timeout_s)
        self._dims: ParallelDims | None = None
        self._mesh: DeviceMesh | None = None
        self._root: nn.Module | None = None  # where FSDP roots: the LightningModule itself makes steps go through it
        self._saved_rng_states: list[dict[str, Any]] | None = None  # from a checkpoint, set at the next batch
        self._shared_dirs: set[str] = set()
        self._trace_prefix: str | None = None  # NCCL flight recorder files (rank appended), when one runs
        self.checkpoint_writer = self._async_writer(async_save)

    def _async_writer(self, async_save: bool) -> AsyncCheckpointWriter | None:
        """The background writer of ``async_save=True`` (lightscale/checkpoint/async_save.py), or ``None``."""
        if not async_save:
            return None
        if not _saves_portable_layout(type(self)):
            supported = sorted(cls.__name__ for cls in _subclasses(LightscaleStrategy) if _saves_portable_layout(cls))
            raise ConfigurationError(
                f"async_save=True is not supported by {type(self).__name__}: it does not save through the portable "
                f"checkpoint writer. Strategies with async_save: {supported}."
            )
        return AsyncCheckpointWriter(timeout=self._timeout)

    # ---- layout -------------------------------------------------------------------------------------------
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

    # ---- devices and processes ---------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide metric syncing and distributed samplers.
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self._backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.dims.sampler_kwargs(self.global_rank)  # ranks sharing a batch (tp, pp) share a data shard

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's padding ``DistributedSampler`` becomes an ``ExactlyOnceSampler`` (strategies/sampler.py): every
        sample once per epoch per data-parallel group, resumed mid-epoch where the checkpoint left off."""
        trainer = self.lightning_module.trainer
        return exactly_once_loader(
            dataloader,
            **self.distributed_sampler_kwargs,
            training=trainer.training,
            drop_remainder=trainer.training and not self.trains_short_batches,
            position=position_in_epoch(trainer),
        )

    @property
    def trains_short_batches(self) -> bool:
        """Whether a training batch may be smaller than the others (an epoch's last); a pipeline runs one shape."""
        return True

    def check_before_launch(self, trainer: Trainer) -> None:
        """Refuse settings that only the Trainer knows (clipping, precision), before any rank starts or connects."""

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = Launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        exit_with_launcher()  # else a rank whose launcher died waits for the launcher's store until the timeout
        if not dist.is_initialized():
            self._trace_prefix = maybe_enable_flight_recorder(self.process_group_backend, self._run_dir())
            store = restart_safe_store(self._timeout)
            kwargs = {"store": store} if store is not None else {}
            _init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._timeout, **kwargs)
            # Destroyed at exit, not in teardown: Lightning calls on_fit_end and later fit()/test() after teardown.
            atexit.register(_destroy_process_group)
        watch_for_failures(self.global_rank)
        self._dims = self.parallel_dims(self.world_size)  # validate the layout before any model work
        trainer = getattr(self.lightning_module, "_trainer", None)
        for callback in trainer.checkpoint_callbacks if trainer is not None else []:
            if getattr(callback, "dirpath", None):  # given explicitly (else resolved later: checked at first save)
                self.check_checkpoint_dir(callback.dirpath)

    def _run_dir(self) -> Path:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return Path(trainer.default_root_dir if trainer is not None else os.getcwd())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

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
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.barrier()  # no rank starts a step (its collectives) before every rank's model is ready

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
        redirection does both."""
        module = self.lightning_module
        assert module is not None and self.model is not None
        if self.model is not module:
            return self._forward_redirection(self.model, module, step, *args, **kwargs)
        if self._root is module:
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
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def check_checkpoint_dir(self, directory: str | Path) -> None:
        """Collective, once per directory: refuse a checkpoint directory that is not shared by every node (multi-node
        runs only; see lightscale/checkpoint/shared_dir.py). Each rank probes the path it resolved itself: the same
        string naming different directories on different nodes is exactly the case to catch."""
        if self.num_nodes <= 1 or "://" in str(directory) or str(directory) in self._shared_dirs:
            return
        ranks = {"node_rank": self.node_rank, "local_rank": self.local_rank, "num_nodes": self.num_nodes}
        check_shared_dir(Path(directory), **ranks)
        self._shared_dirs.add(str(directory))

    # ---- collectives ---------------------------------------------------------------------------------------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        announce_failure(self.global_rank, exception, where=self._failure_context(exception))  # not at the timeout

    def _failure_context(self, exception: BaseException) -> str:
        # _trainer: an error raised before fit attached the module (at launch) must not turn into "not attached".
        trainer = getattr(self.lightning_module, "_trainer", None)
        stage = trainer.state.stage.value if trainer is not None and trainer.state.stage else "start-up"
        where = f"{stage}, step {trainer.global_step}" if trainer is not None else stage
        if "Timed out" in str(exception) or isinstance(exception, TimeoutError):
            where += f"; a collective timed out after {self._timeout.total_seconds():.0f} s: a rank that did not arrive"
            where += " prints where it was"
            if self._trace_prefix is not None:
                where += f"; NCCL flight recorder traces of every rank: {self._trace_prefix}<rank>"
        return where

    # ---- checkpoints: the portable layout (lightscale/checkpoint/layout.py) --------------------------------
    # Whether weights copied into the model after setup are the ones trained; False where an engine builds its own
    # fp32 master copies at setup (ZeRO). InitWeights (callbacks/init_weights.py) refuses strategies without it.
    weights_settable_after_setup: ClassVar[bool] = True

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the layout loads into the parallelized model and its optimizers, which setup creates

    @contextmanager
    def checkpoint_module(self) -> Iterator[nn.Module]:
        """The module whose state a checkpoint holds, under the LightningModule's own parameter names."""
        yield self.lightning_module

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write ``filepath`` as a directory in the one layout every lightscale strategy reads: DCP shards of model
        and optimizer (keyed by parameter name) plus the rest of Lightning's checkpoint in ``trainer_state.pt``."""
        path = Path(self.broadcast(str(filepath)))
        self.check_checkpoint_dir(path.parent)  # multi-node: refuse a directory not every node shares
        with self.checkpoint_module() as module:
            rest = self.trainer_state(checkpoint)
            save_file = self.checkpoint_io.save_checkpoint
            save_sharded(path, module, self.optimizers, rest, save_file, writer=self.checkpoint_writer)

    def trainer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Lightning's checkpoint without the tensors DCP writes, plus the ``lightscale`` entry naming the writer and
        holding every rank's random state (collective)."""
        return trainer_state_of(checkpoint, strategy=type(self).__name__, world_size=self.world_size)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the layout saved by any lightscale strategy at any world size (DCP reshards); a single-file
        Lightning checkpoint (``.ckpt`` of earlier bucketed_ddp versions, one device) where ``reads_single_files``."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_file() and self.reads_single_files:
            return super().load_checkpoint(path, weights_only=weights_only)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        with self.checkpoint_module() as module:
            read = load_sharded(path, module, self.optimizers if fitting else [])
        meta = self.read_trainer_state(read, fitting=fitting)
        return {**meta, "optimizer_states": []}  # loaded above; Lightning's optimizer restore then does nothing

    def read_trainer_state(self, checkpoint_dir: Path, *, fitting: bool) -> dict[str, Any]:
        """``trainer_state.pt`` of a layout directory (weights-only); when fitting, its random states are kept for
        the first batch: creating the data iterator after the load draws from torch's RNG."""
        meta = self.checkpoint_io.load_checkpoint(checkpoint_dir / TRAINER_STATE)
        if fitting:
            self._saved_rng_states = saved_rng_states(meta)
        return meta

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        states, self._saved_rng_states = self._saved_rng_states, None
        if states is not None:
            restore_rng_states(states)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A single file (the layout was loaded in load_checkpoint); a differently shaped model's is refused naming
        the keys and shapes."""
        if "state_dict" in checkpoint:
            check_state_dict_shapes(
                checkpoint["state_dict"], self.lightning_module.state_dict(), "the checkpoint (ckpt_path)"
            )
            super().load_model_state_dict(checkpoint, strict=strict)

    # ---- registry and teardown -----------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, (description, init_params) in cls.__dict__.get("aliases", {}).items():  # not the parent's
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

    @override
    def teardown(self) -> None:
        if self.checkpoint_writer is not None:
            self.checkpoint_writer.wait()  # the last save of fit is published before fit returns
        lightning_module = self.lightning_module
        if lightning_module is not None:
            self.model = lightning_module  # drop wrappers; hooks are removed by the subclass
            if self._layer_sync and lightning_module._trainer is not None:
                self.model = self._layer_sync.revert(self.model)
        super().teardown()


def _saves_portable_layout(cls: type) -> bool:
    """Whether ``cls`` saves through :meth:`LightscaleStrategy.save_checkpoint` (what ``async_save`` runs in)."""
    return cls.save_checkpoint is LightscaleStrategy.save_checkpoint


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]
