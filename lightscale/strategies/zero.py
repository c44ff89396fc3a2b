"""The ZeRO family on DeepSpeed's engine: zero1, zero2, zero2_offload, zero3, zero3_offload, zero_infinity.

Runs on CPU (gloo) as well as CUDA (nccl), unlike Lightning's DeepSpeedStrategy. The engine config is generated
(lightscale/zero/config.py); the engine owns backward, gradient partitioning, clipping and the
optimizer step, while Lightning keeps owning the loop: gradient accumulation (the engine is told where the
boundary is), LR schedulers (stepped per optimizer step, as under every other strategy) and logging.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from typing_extensions import override

from lightscale.checkpoint.portable import AVERAGED, lightning_rest, with_average, write_checkpoint
from lightscale.checkpoint.zero_load import load_zero_state_dict
from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import DEEPSPEED_PERSISTENCE_THRESHOLD, Layout
from lightscale.estimate.plan import Plannable
from lightscale.optim.combined import CombinedOptimizer
from lightscale.optim.flat_muon import FlatMuon
from lightscale.optim.install import attach_flat, exact_optimizer
from lightscale.optim.rule import ParameterView
from lightscale.parallel.zeropp import GradientWire, WeightWire, ZeroPPOptions
from lightscale.patches.deepspeed import extensions_dir, replace_checkpoint_engine
from lightscale.plugins.fsdp_precision import precision_name
from lightscale.plugins.precision_contract import (
    Compression,
    PrecisionRules,
    check_compression,
    enforce_contract,
    float8_refused,
    refuse_impossible,
)
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.strategies.base import SEVERAL_OPTIMIZERS, LightscaleStrategy
from lightscale.strategies.weight_averaging import adopt_weight_averaging, drop_average
from lightscale.zero.checkpoint_dir import (
    CHECKPOINT_TAG,
    load_engine_directory,
    safe_checkpoint_engine,
    save_engine_directory,
)
from lightscale.zero.config import (
    ZeroOptions,
    build_config,
    check_zeropp_device,
    micro_batch_size,
    read_user_config,
    validate_user_config,
    writable_dir,
)
from lightscale.zero.engine import (
    EngineRoot,
    check_async_io,
    check_zero_optimizer,
    explain_partitioned_shapes,
    host_optimizer,
    not_a_boundary,
    rebind_scheduler,
    refuse_moe,
    require_deepspeed,
    scalars_as_vectors,
    silence_deepspeed_noise,
)
from lightscale.zero.optimizer_tensors import gradient_partitions, master_partitions
from lightscale.zero.partition import (
    flat_groups,
    full_numel,
    is_partitioned,
    largest_parameter,
    partition,
    regather_persistent,
    stored_tensors,
    whole_shape,
)
from lightscale.zero.portable import group_parameter_names, zero_optimizer, zero_state_dict
from lightscale.zero.precision import DEEPSPEED_MEANINGS, FP16_NEEDS_CUDA, NO_FLOAT8

CheckpointFormat = Literal["dcp", "deepspeed"]


class ZeroStrategy(LightscaleStrategy):
    """ZeRO data parallelism on DeepSpeed: shard optimizer state (stage 1), gradients (2) and parameters (3).

    Args:
        stage: 1, 2 or 3.
        offload_optimizer: keep optimizer state (and the fp32 master weights) in host memory and step it there:
            Adam/AdamW as DeepSpeed's CPU Adam, any other torch optimizer as torch's own implementation.
        offload_params: keep parameters in host memory between uses (stage 3).
        nvme_path: offload to files in this directory instead of host memory (ZeRO-Infinity); default under
            the run's log dir when ``zero_infinity`` is chosen by name.
        compression: ``"bf16"``/``"fp16"`` reduce gradients in that dtype (DeepSpeed's ``communication_data_type``)
            instead of fp32, the same option as ``bucketed_ddp``'s (docs/plugins/precision.md).
        quantized_weights: ``"int8"``: DeepSpeed's ZeRO++ qwZ (``zero_quantized_weights``); stage 3, CUDA only.
        quantized_gradients: ``"int4"``: DeepSpeed's ZeRO++ qgZ (``zero_quantized_gradients``); stage 3, CUDA only.
        secondary_shard: ranks per hpZ group (``zero_hpz_partition_size``; ``"node"``: the processes per node).
            The same three arguments as :class:`~lightscale.strategies.fsdp2.FSDP2Strategy`'s; on CPU they are
            refused when the Trainer is built (DeepSpeed's quantizer is a CUDA kernel).
        config: extra DeepSpeed engine options (a dict or a JSON file path). Keys the Trainer or the strategy
            already set, unknown keys and misplaced keys are errors.
        checkpoint_format: ``"dcp"`` (default) saves the portable layout every lightscale strategy loads, on any
            number of ranks (lightscale/zero/portable.py); ``"deepspeed"`` saves DeepSpeed's own engine
            directory (loads under ZeRO only). Either kind of directory is resumed, whatever this is set to.
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`.

    Example:
        >>> Trainer(strategy=ZeroStrategy(stage=3, offload_optimizer=True, config={"zero_optimization":
        ...     {"overlap_comm": True}}), accelerator="cpu", devices=2)
    """

    # DeepSpeed's engines: their own meaning of every precision but float8 (lightscale/zero/precision.py).
    precision_rules = PrecisionRules(
        "zero", meanings=DEEPSPEED_MEANINGS, refused={("16-mixed", "cpu"): FP16_NEEDS_CUDA, **float8_refused(NO_FLOAT8)}
    )
    aliases = {
        "zero1": ("ZeRO-1 on DeepSpeed: optimizer state sharded", {"stage": 1}),
        "zero2": ("ZeRO-2 on DeepSpeed: optimizer state and gradients sharded", {"stage": 2}),
        "zero2_offload": ("ZeRO-2 with optimizer state and step on the CPU", {"stage": 2, "offload_optimizer": True}),
        "zero3": ("ZeRO-3 on DeepSpeed: optimizer state, gradients and parameters sharded", {"stage": 3}),
        "zero3_offload": (
            "ZeRO-3 with optimizer state and parameters on the CPU",
            {"stage": 3, "offload_optimizer": True, "offload_params": True},
        ),
        "zero_infinity": (
            "ZeRO-3 with optimizer state and parameters offloaded to NVMe files",
            {"stage": 3, "offload_optimizer": True, "offload_params": True, "nvme_path": "auto"},
        ),
    }
    checkpoint_formats = get_args(CheckpointFormat)
    parameter_view = "flat"  # DeepSpeed steps flat 1-D partitions (optim/rule.py): see parameter_view_for
    plannable = (
        Plannable("zero1", "2Ψ", "optimizer state sharded", needs="deepspeed"),
        Plannable("zero2", "2Ψ", "+ gradients sharded", needs="deepspeed"),
    )
    memory_alternatives = (("zero2", None), ("zero3", None))

    @classmethod
    @override
    def parameter_view_for(cls, init_params: dict[str, Any]) -> ParameterView:
        """Flat partitions whose layout lightscale reads (torch's Muon runs there as FlatMuon), except ZeRO-Infinity's,
        which DeepSpeed swaps to NVMe files."""
        return "flat" if init_params.get("nvme_path") else "flat_mapped"

    @override
    def optimizer_parameter_view(self) -> ParameterView:
        return type(self).parameter_view_for({"nvme_path": self.options.nvme_path or self._nvme_auto})

    @override
    def local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """A ZeRO-3 parameter's piece is its partition, persistent or not (lightscale/zero/partition.py)."""
        return partition(tensor) if is_partitioned(tensor) else super().local_shard(tensor)

    @override
    def after_local_write(self, module: nn.Module) -> None:
        regather_persistent(list(module.parameters()))

    @override
    def global_shape(self, tensor: torch.Tensor) -> torch.Size:
        return whole_shape(tensor)

    @override
    def global_numel(self, tensor: torch.Tensor) -> int:
        return full_numel(tensor) if is_partitioned(tensor) else super().global_numel(tensor)

    @override
    def is_flat_slice(self, tensor: torch.Tensor) -> bool:
        return is_partitioned(tensor)

    @override
    def parameter_tensors(self, param: torch.Tensor) -> list[torch.Tensor]:
        """The partition, and the whole data while a ZeRO-3 parameter is gathered (persistent ones always are)."""
        return stored_tensors(param) if is_partitioned(param) else super().parameter_tensors(param)

    @override
    def optimizer_gradient_tensors(self, optimizer: Any) -> Iterator[torch.Tensor]:
        return gradient_partitions(optimizer)

    @override
    def optimizer_state_tensors(self, optimizer: Any) -> Iterator[torch.Tensor]:
        """The fp32 master partitions, then the wrapped torch optimizer's state."""
        yield from master_partitions(optimizer)
        yield from super().optimizer_state_tensors(optimizer)

    @override
    def memory_layout(self, world_size: int) -> Layout:
        """Stage 1 shards optimizer state, 2 gradients too, 3 parameters too; offload moves them to the host."""
        stage, offload_optimizer, offload_params = (
            self.options.stage,
            self.options.offload_optimizer,
            self.options.offload_params,
        )
        return _zero_layout(type(self).__name__, world_size, stage, offload_optimizer, offload_params, self.user_config)

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """From the init parameters alone: `lightscale plan` and ``fit_memory`` describe ZeRO without DeepSpeed."""
        config = read_user_config(init_params.get("config"))
        stage, offload_optimizer = init_params.get("stage", 2), init_params.get("offload_optimizer", False)
        offload_params = init_params.get("offload_params", False)
        return _zero_layout(cls.__name__, world_size, stage, offload_optimizer, offload_params, config)

    def __init__(
        self,
        *,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        nvme_path: str | None = None,
        config: dict[str, Any] | str | None = None,
        compression: Compression = "none",
        quantized_weights: WeightWire = "none",
        quantized_gradients: GradientWire = "none",
        secondary_shard: int | Literal["node"] | None = None,
        checkpoint_format: CheckpointFormat = "dcp",
        **kwargs: Any,
    ) -> None:
        require_deepspeed()
        super().__init__(checkpoint_format=checkpoint_format, **kwargs)
        check_compression(compression, self.precision_rules)
        self.compression = compression
        self._group_names: list[list[str]] = []
        zeropp = ZeroPPOptions(quantized_weights, quantized_gradients, secondary_shard)
        nvme = None if nvme_path == "auto" else nvme_path
        self.options = ZeroOptions(stage, offload_optimizer, offload_params, nvme, zeropp=zeropp)
        self._nvme_auto = nvme_path == "auto"
        if nvme_path is not None and not self._nvme_auto:
            writable_dir(Path(nvme_path))  # at construction, before any process starts
        self.user_config = read_user_config(config)
        validate_user_config(self.user_config)  # fail at construction, before any process starts
        self.config: dict[str, Any] | None = None
        self._engine: Any = None

    @override
    def set_world_ranks(self) -> None:
        """The Trainer's constructor calls this once the accelerator is chosen: ZeRO++ off CUDA is refused here."""
        super().set_world_ranks()
        if self.parallel_devices:
            check_zeropp_device(self.options.zeropp, self.root_device.type)

    @property
    def engine(self) -> Any:
        """DeepSpeed's engine; kept after teardown so ``trainer.save_checkpoint`` works after ``fit``."""
        return self._engine

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # the engine restores its partitioned optimizer state itself

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine must exist before its checkpoint can be loaded

    # ---- set-up -----------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # DeepSpeed JIT-builds its CPU ops (CPU Adam, shared-memory comm) once per virtual environment.
        extensions_dir()
        silence_deepspeed_noise()
        import deepspeed

        deepspeed.init_distributed(self.process_group_backend, dist_init_required=False)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin = DeepSpeedPrecision(precision_name(self.precision_plugin))
        self._check_trainer(trainer, self.precision_plugin.precision)
        enforce_contract(
            self.precision_rules,
            self.precision_plugin.precision,
            device_type=self.root_device.type,
            compression=self.compression,
        )
        fitting = trainer.state.fn == TrainerFn.FITTING
        refuse_moe(self.lightning_module)
        if not fitting and self._engine_wraps(self.lightning_module):
            self.model, self.optimizers, self.lr_scheduler_configs = self._engine, [], []  # evaluate after fit
            return
        optimizer, scheduler = self._optimizer_and_scheduler(self.lightning_module) if fitting else (None, None)
        self.config = build_config(
            self._resolved_options(trainer),
            micro_batch_size=micro_batch_size(trainer),
            accumulate=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            precision=self.precision_plugin.precision,
            compression=self.compression,
            user_config=self.user_config,
            torch_optimizer_on_host=optimizer is not None and type(optimizer).__name__ != "DeepSpeedCPUAdam",
            processes_per_node=self.num_processes,
            largest_parameter=largest_parameter(self.lightning_module),
        )
        if not fitting and self.options.stage < 3:
            # Evaluation needs no optimizer, and ZeRO-1/2 partition only optimizer state and gradients: a plain
            # engine holds the (replicated) weights and still loads the checkpoint's module states.
            self.config["zero_optimization"] = {"stage": 0}
        self.model = self._engine = self._initialize_engine(self.lightning_module, optimizer)
        if isinstance(optimizer, (FlatMuon, CombinedOptimizer)):  # where each matrix, each part's partition lies
            attach_flat(optimizer, flat_groups(zero_optimizer(self._engine)))
        self.optimizers = [self.model.optimizer] if fitting else []
        self.lr_scheduler_configs = [scheduler] if scheduler is not None else []
        if scheduler is not None:
            rebind_scheduler(scheduler.scheduler, optimizer)  # type: ignore[arg-type]
        if fitting:
            adopt_weight_averaging(trainer, self.lightning_module)
        self.barrier()

    def _engine_wraps(self, module: LightningModule) -> bool:
        root = getattr(self._engine, "module", None)
        return isinstance(root, EngineRoot) and root._lightning_module[0] is module

    @override
    def check_before_launch(self, trainer: Trainer) -> None:
        super().check_before_launch(trainer)
        self._check_trainer(trainer, precision_name(self.precision_plugin))
        if self._nvme_auto:
            writable_dir(Path(self._nvme_options(trainer).nvme_path or "."))

    def _check_trainer(self, trainer: Trainer, precision: str) -> None:
        if trainer.gradient_clip_algorithm == "value" and trainer.gradient_clip_val:
            raise ConfigurationError(
                "gradient_clip_algorithm='value' is not valid under the ZeRO strategies: DeepSpeed clips gradients "
                "by norm only; use gradient_clip_algorithm='norm'."
            )
        refuse_impossible(
            self.precision_rules, precision, device_type=self.root_device.type, compression=self.compression
        )

    def _resolved_options(self, trainer: Trainer) -> ZeroOptions:
        options = self._nvme_options(trainer) if self._nvme_auto else self.options
        if options.nvme_path:
            writable_dir(Path(options.nvme_path))
            check_async_io()
        return options

    def _nvme_options(self, trainer: Trainer) -> ZeroOptions:
        # One swap directory per rank: ZeRO-Infinity file names are not unique across ranks of one machine.
        path = Path(trainer.log_dir or trainer.default_root_dir) / "zero_infinity_swap" / f"rank{self.global_rank}"
        return dataclasses.replace(self.options, offload_optimizer=True, offload_params=True, nvme_path=str(path))

    def _optimizer_and_scheduler(
        self, module: LightningModule
    ) -> tuple[torch.optim.Optimizer, LRSchedulerConfig | None]:
        with explain_partitioned_shapes(module):  # ZeRO-3 parameters built in configure_model show shape (0,)
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise ConfigurationError(
                f"The ZeRO strategies need exactly one optimizer and at most one LR scheduler; configure_optimizers "
                f"returned {len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s). {SEVERAL_OPTIMIZERS}"
            )
        optimizer = optimizers[0]
        self.check_optimizers([optimizer])  # shape-dependent optimizers: exact (Muon at stage 1/2) or refused
        check_zero_optimizer(optimizer)
        optimizer = exact_optimizer(optimizer, self.optimizer_parameter_view())  # torch's Muon: FlatMuon
        self._group_names = group_parameter_names(module, optimizer)
        if self.options.offload_optimizer:
            optimizer = host_optimizer(optimizer, self.user_config)
        return optimizer, schedulers[0] if schedulers else None

    def _initialize_engine(self, module: LightningModule, optimizer: torch.optim.Optimizer | None) -> Any:
        import deepspeed

        parameters = [p for p in module.parameters() if p.requires_grad]
        stage = self.config["zero_optimization"]["stage"]
        with scalars_as_vectors(module, stage=stage):  # DeepSpeed cannot start with 0-dim parameters; users keep them
            engine, *_ = deepspeed.initialize(
                model=EngineRoot(module),
                model_parameters=parameters if optimizer is not None else None,
                optimizer=optimizer,
                config=self.config,
                dist_init_required=False,
            )
        replace_checkpoint_engine(engine, safe_checkpoint_engine)  # resume loads weights-only
        return engine

    @contextmanager
    @override
    def model_sharded_context(self):  # type: ignore[override]
        """Parameters created in ``configure_model`` are partitioned as they are built (stage 3)."""
        import deepspeed

        enabled = self.options.stage == 3
        with deepspeed.zero.Init(enabled=enabled, config_dict_or_path=self._init_config() if enabled else None):
            yield

    def _init_config(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return build_config(
            self._resolved_options(self.lightning_module.trainer),  # checks the offload path before any work
            micro_batch_size=1,
            accumulate=1,
            gradient_clip_val=None,
            precision="32-true",
            user_config=self.user_config,
            processes_per_node=self.num_processes,
        )

    # ---- the step ---------------------------------------------------------------------------------------
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning already divided the loss by accumulate_grad_batches: the engine must not divide again.
        return super().backward(closure_loss, optimizer, *args, scale_wrt_gas=False, **kwargs)

    @override
    def gradient_sync_context(self) -> AbstractContextManager:
        return not_a_boundary(self.engine)

    @override
    def model_to_device(self) -> None:
        pass  # the engine places (or offloads) parameters itself

    # ---- checkpoints ------------------------------------------------------------------------------------
    weights_settable_after_setup = False  # the engine builds its fp32 masters from the weights at setup

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine's state is saved by save_checkpoint; nothing is gathered here

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save the portable layout (``checkpoint_format="dcp"``) or DeepSpeed's engine directory, atomically."""
        target = self.checkpoint_location(filepath)  # a local path or an fsspec URL
        self.check_checkpoint_dir(target.parent)  # multi-node: refuse a directory not every node shares
        if self.checkpoint_format == "deepspeed":
            drop_average(checkpoint, "checkpoint_format='deepspeed' keeps no weight average")
            save_engine_directory(self.engine, target, lightning_rest(checkpoint))
            return
        rest = self.trainer_state(checkpoint)
        state = zero_state_dict(self.engine, self.lightning_module, self._group_names)
        state.update(with_average(checkpoint.get(AVERAGED)))
        write_checkpoint(target, state, rest, self.checkpoint_io.save_checkpoint)

    @override
    def saved_optimizers(self) -> list[dict[str, Any]] | None:
        """The user's optimizer (DeepSpeed's inner one) and its groups' names, recorded before DeepSpeed flattened
        them."""
        zero = zero_optimizer(self.engine) if self.optimizers else None
        return [] if zero is None else [{"class": type(zero.optimizer).__name__, "groups": self._group_names}]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume from either format, told apart by its files: DeepSpeed's directory has a tag sub-directory."""
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path = complete_checkpoint(self.checkpoint_location(checkpoint_path))
        if (path / CHECKPOINT_TAG).is_dir():
            return load_engine_directory(self.engine, path, fitting=fitting)
        read = load_zero_state_dict(path, self.engine, self.lightning_module, self._group_names, optimizer=fitting)
        return self.read_trainer_state(read, fitting=fitting)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded by the engine in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded by the engine in load_checkpoint

    @override
    def teardown(self) -> None:
        if self.model is not None and self.lightning_module is not None:
            self.model = self.lightning_module
        super().teardown()


# DeepSpeed calls collectives torch has deprecated, once per parameter fetch: hundreds of identical lines that
# drown the user's own warnings. Matched by message and by torch's warning site, so nothing else is hidden.


def _zero_layout(
    name: str, world_size: int, stage: int, offload_optimizer: bool, offload_params: bool, config: dict[str, Any]
) -> Layout:
    zero = config.get("zero_optimization", {})
    threshold = zero.get("stage3_param_persistence_threshold", DEEPSPEED_PERSISTENCE_THRESHOLD)
    return Layout(
        name,
        world_size,
        engine="deepspeed",
        shard_optimizer=True,
        shard_gradients=stage >= 2,
        shard_parameters=stage == 3,
        dp_shard=world_size,
        offload_optimizer=offload_optimizer,
        offload_parameters=offload_params,
        persistence_threshold=threshold if stage == 3 else 0,
    )
