"""``diloco``, ``streaming_diloco``, ``local_sgd``: workers train alone for ``H`` optimizer steps, then meet.

A *worker* is a group of ranks running an inner data-parallel strategy (``bucketed_ddp``'s reducer or FSDP2 over
the worker's ranks); the layout is ``ParallelDims(dp_replicate=workers, dp_shard=ranks per worker)``. After every
``sync_every``-th optimizer step (Lightning's, so gradient accumulation counts steps, not micro-batches)
:class:`~lightscale.parallel.diloco.OuterSync` averages the pseudo-gradients (or, for ``local_sgd``, the parameters)
over the ``dp_replicate`` group of each shard position. Every rank reads its own data shard (dp = workers x inner).
Validation and checkpoints' ``model.*`` entries see the fp32 global model (lightscale/checkpoint/diloco_state.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightscale.checkpoint.diloco_state import diloco_state, load_diloco_state, read_diloco_state
from lightscale.checkpoint.layout import write_checkpoint
from lightscale.errors import ConfigurationError
from lightscale.estimate.layout import Layout
from lightscale.parallel.contract import data_parallel_roots, manual_optimization, sharding_units
from lightscale.parallel.data_parallel import BucketedGradReducer, broadcast_module_state
from lightscale.parallel.diloco import OuterSync, Schedule, check_outer_settings
from lightscale.parallel.fsdp import apply_fsdp, contains_module, no_gradient_sync
from lightscale.parallel.mesh import ParallelDims
from lightscale.plugins.fsdp_precision import fsdp2_precision_plugin, mp_policy, precision_name
from lightscale.plugins.precision_contract import enforce_contract
from lightscale.strategies.base import SEVERAL_OPTIMIZERS, LightscaleStrategy

Inner = Literal["bucketed_ddp", "fsdp2"]
INNERS: tuple[str, ...] = ("bucketed_ddp", "fsdp2")


class DiLoCoStrategy(LightscaleStrategy):
    """DiLoCo (Douillard et al. 2023), its streaming variant and local SGD, with data parallelism inside workers.

    Args:
        workers: replica groups that sync every ``sync_every`` steps; default one per node on several nodes, one
            per rank on one machine. Must divide the world size.
        inner: the data parallelism inside a worker, ``"bucketed_ddp"`` or ``"fsdp2"``.
        sync_every: ``H``, optimizer steps between two syncs (of each fragment).
        outer_lr, outer_momentum: the outer SGD (Nesterov when momentum > 0); the paper's 0.7 and 0.9.
        fragments, overlap_steps: streaming DiLoCo: ``fragments`` staggered parts, each collective overlapped with
            ``overlap_steps`` inner steps.
        compression: the outer wire, ``"none"``, ``"bf16"`` or ``"int8"`` (diloco mode only).
        mode: ``"diloco"`` (outer optimizer on the mean pseudo-gradient) or ``"local_sgd"`` (mean of parameters).
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy` (``timeout_s``, ...).

    Example:
        >>> Trainer(strategy=DiLoCoStrategy(workers=4, sync_every=50, compression="int8"), devices=8)
    """

    precision_family = "bucketed_ddp"  # the default inner's column; inner="fsdp2" is checked against fsdp2's
    aliases = {
        "diloco": ("DiLoCo: workers sync every H=100 steps, outer Nesterov SGD on the mean pseudo-gradient", {}),
        "streaming_diloco": (
            "DiLoCo in 4 staggered fragments, each sync overlapped with one inner step",
            {"fragments": 4, "overlap_steps": 1},
        ),
        "local_sgd": ("local SGD: workers average their parameters every H=100 steps", {"mode": "local_sgd"}),
    }
    plannable = ()
    reads_single_files = False
    checkpoint_formats = ("dcp", "file")  # "file": the global model (inner="bucketed_ddp": whole on every rank)

    def __init__(
        self,
        *,
        workers: int | None = None,
        inner: Inner = "bucketed_ddp",
        sync_every: int = 100,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        overlap_steps: int = 0,
        compression: str = "none",
        mode: str = "diloco",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_settings(workers, inner, outer_lr, outer_momentum)
        if inner == "fsdp2" and self.checkpoint_format == "file":
            raise ConfigurationError(
                "checkpoint_format='file' needs the global model whole on every rank; inner='fsdp2' shards it. Use "
                "inner='bucketed_ddp', or checkpoint_format='dcp' and `lightscale consolidate` for one file."
            )
        check_outer_settings(mode, compression)
        self.schedule = Schedule(sync_every, fragments, overlap_steps)
        self.workers, self.inner, self.mode, self.compression = workers, inner, mode, compression
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.reducer: BucketedGradReducer | None = None
        self.outer: OuterSync | None = None
        self._kept_locals: list[torch.Tensor] | None = None

    @override
    def memory_layout(self, world_size: int) -> Layout:
        """The inner layout inside a worker; the fp32 global copy and outer momentum come on top (docs/strategies)."""
        dims = self.parallel_dims(world_size)
        sharded = self.inner == "fsdp2"
        return Layout(
            type(self).__name__, world_size, shard_optimizer=sharded, shard_gradients=sharded,
            shard_parameters=sharded, dp_shard=dims.dp_shard if sharded else 1,
            dp_replicate=dims.dp_replicate if sharded else world_size,
        )  # fmt: skip

    # ---- layout -------------------------------------------------------------------------------------------
    @override
    def parallel_dims(self, world_size: int) -> ParallelDims:
        workers = self.workers or (self.num_nodes if self.num_nodes > 1 else world_size)
        if world_size % workers:
            valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigurationError(
                f"workers={workers} does not divide the world size {world_size}: every worker needs the same number "
                f"of ranks. Choose workers from {valid}."
            )
        return ParallelDims(world_size=world_size, dp_replicate=workers, dp_shard=world_size // workers)

    @property
    def worker(self) -> int:
        return self.global_rank // self.dims.dp_shard

    @property
    def shard(self) -> int:
        """This rank's position among its worker's shards (0 when the inner strategy replicates)."""
        return self.global_rank % self.dims.dp_shard if self.inner == "fsdp2" else 0

    # ---- the model -----------------------------------------------------------------------------------------
    @override
    def configure_precision(self, plugin: Precision) -> Precision:
        name = precision_name(plugin)
        enforce_contract(self.inner, name, device_type=self.root_device.type)  # type: ignore[arg-type]
        return fsdp2_precision_plugin(name, self.root_device.type) if self.inner == "fsdp2" else plugin

    @override
    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        """Every rank starts from rank 0's weights; the inner strategy over the worker, OuterSync across workers."""
        broadcast_module_state(module)
        mesh = self.device_mesh
        if self.inner == "fsdp2":
            self._roots = data_parallel_roots(module, strategy=type(self).__name__)
            policy = mp_policy(precision_name(self.precision_plugin), "none")
            units = sharding_units(module)
            for root in self._roots:
                inside = [unit for unit in units if contains_module(root, unit)]
                apply_fsdp(
                    root, mesh["dp_shard"], units=inside, mp_policy=policy,
                    root_reshard_after_forward=manual_optimization(module),
                )  # fmt: skip
        elif self.dims.dp_shard > 1:
            self.reducer = BucketedGradReducer(module, process_group=mesh["dp_shard"].get_group())
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self.outer = OuterSync(
                module.named_parameters(), sync_every=self.schedule.sync_every, group=mesh["dp_replicate"].get_group(),
                mode=self.mode, outer_optimizer=self._outer_optimizer if self.mode == "diloco" else None,
                fragments=self.schedule.fragments, overlap_steps=self.schedule.overlap_steps,
                compression=self.compression, broadcast_start=False,
            )  # fmt: skip
        return module

    def _outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        momentum = self.outer_momentum
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=momentum, nesterov=momentum > 0)

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
        assert self.model is not None
        if self.inner != "fsdp2":
            self.model.to(self.root_device)

    # ---- the step ------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.reducer is not None:
            self.reducer.sync_buffers()
        return super().training_step(*args, **kwargs)

    @override
    def gradient_sync_context(self) -> AbstractContextManager:
        if self.inner == "fsdp2":
            return no_gradient_sync(self.model)
        return self.reducer.no_sync() if self.reducer is not None else nullcontext()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning calls this once per optimizer step (after accumulation): the outer step follows the inner one."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.outer is not None:
            self.outer.after_inner_step(self.outer.step + 1)
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
        if self.outer is not None:
            self._kept_locals = [self.outer.local(i).clone() for i in range(len(self.outer.params))]
            with torch.no_grad():
                for i, (_, tensor) in enumerate(self.outer.named_globals()):
                    self.outer.local(i).copy_(tensor)

    @override
    def on_validation_end(self) -> None:
        if self.outer is not None and self._kept_locals is not None:
            with torch.no_grad():
                for i, kept in enumerate(self._kept_locals):
                    self.outer.local(i).copy_(kept)
            self._kept_locals = None
        super().on_validation_end()

    # ---- checkpoints -------------------------------------------------------------------------------------
    def _globals(self) -> dict[str, torch.Tensor]:
        """The fp32 global model under the module's names; DTensors over the worker's shards when FSDP2 shards."""
        assert self.outer is not None
        out = {}
        for param, (name, tensor) in zip(self.outer.params, self.outer.named_globals(), strict=True):
            if isinstance(param, DTensor):
                tensor = DTensor.from_local(tensor, param.device_mesh, param.placements, shape=param.shape,
                                            stride=param.stride(), run_check=False)  # fmt: skip
            out[name] = tensor
        return out

    def _buffers(self) -> dict[str, torch.Tensor]:
        """The module's persistent buffers (the same on every rank): saved beside the global parameters so that the
        ``model.*`` entries are the module's whole ``state_dict``; loading fills them in place."""
        module = self.lightning_module
        params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        state = module.state_dict(keep_vars=True)
        return {name: t for name, t in state.items() if name not in params and isinstance(t, torch.Tensor)}

    @override
    def saved_optimizers(self) -> list[dict[str, Any]] | None:
        """None while training: each worker's inner state is its own (``diloco.*``), no ``optimizer.*`` entries."""
        return super().saved_optimizers() if self.outer is None else None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.outer is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        self.check_checkpoint_dir(path.parent)
        if self.checkpoint_format == "file":  # the global model only: the workers' own state has no file form
            model = {name: tensor.detach() for name, tensor in {**self._globals(), **self._buffers()}.items()}
            rest = {key: value for key, value in checkpoint.items() if key != "optimizer_states"}
            self.save_single_file({**rest, "state_dict": model}, path)
            return None
        tensors, meta = diloco_state(self.outer, self.optimizers[0], worker=self.worker, shard=self.shard)
        meta["workers"] = self.dims.dp_replicate
        rest = {**self.trainer_state(checkpoint), "diloco": meta}
        model = {**self._globals(), **self._buffers()}
        write_checkpoint(path, {"model": model, "diloco": tensors}, rest, self.checkpoint_io.save_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume (same workers and shards): globals, each worker's own state, the outer state; else the global model
        loads like any layout's (evaluation, or a checkpoint another strategy wrote)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if self.outer is None:
            return super().load_checkpoint(path, weights_only)
        if path.is_file():
            raise ConfigurationError(
                f"{path} is a single file; DiLoCo resumes from its portable layout (checkpoint_format='dcp'), which "
                "holds every worker's own state. Evaluate the file, or start a new run from its weights (InitWeights)."
            )
        meta = self.read_trainer_state(path, fitting=True)
        saved = meta.get("diloco")
        if saved is None or saved["workers"] != self.dims.dp_replicate:
            raise ConfigurationError(
                f"{path} was not saved by DiLoCo with {self.dims.dp_replicate} workers (saved: "
                f"{None if saved is None else saved['workers']}); resume with the saved layout, or load its global "
                f"model into a new run with `lightscale export`."
            )
        tensors = read_diloco_state(path, {**self._globals(), **self._buffers()}, worker=self.worker, shard=self.shard)
        load_diloco_state(self.outer, self.optimizers[0], tensors, saved, worker=self.worker, shard=self.shard)
        return {**meta, "optimizer_states": []}

    @override
    def teardown(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        self.outer = None
        super().teardown()


def _check_settings(workers: int | None, inner: str, outer_lr: float, outer_momentum: float) -> None:
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ConfigurationError(f"workers={workers!r} is not valid; use a positive integer or None (one per node).")
    if inner not in INNERS:
        raise ConfigurationError(
            f"inner={inner!r} cannot run inside a DiLoCo worker; choose one of {', '.join(INNERS)} (engines that own "
            f"the optimizer step, such as DeepSpeed's ZeRO, and tp/pp layouts do not nest)."
        )
    if not (isinstance(outer_lr, int | float) and outer_lr > 0):
        raise ConfigurationError(f"outer_lr={outer_lr!r} is not valid; it must be > 0 (the DiLoCo paper uses 0.7).")
    if not (isinstance(outer_momentum, int | float) and 0 <= outer_momentum < 1):
        raise ConfigurationError(f"outer_momentum={outer_momentum!r} is not valid; use 0 <= momentum < 1 (paper: 0.9).")
