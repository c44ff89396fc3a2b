"""The ZeRO family on DeepSpeed's engine: zero1, zero2, zero2_offload, zero3, zero3_offload, zero_infinity.

Runs on CPU (gloo) as well as CUDA (nccl), unlike Lightning's DeepSpeedStrategy. The engine config is generated
(lightscale/strategies/deepspeed/config.py); the engine owns backward, gradient partitioning, clipping and the
optimizer step, while Lightning keeps owning the loop: gradient accumulation (the engine is told where the
boundary is), LR schedulers (stepped per optimizer step, as under every other strategy) and logging. This class is
the Lightning-facing side: DeepSpeed is started through lightscale/strategies/deepspeed/build.py, the shard answers are
strategies/deepspeed/shards.py's, its checkpoints strategies/deepspeed/checkpoint.py's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.estimate.plan import Plannable
from lightscale.optim.install import exact_optimizer
from lightscale.optim.rule import ParameterView
from lightscale.parallel.fsdp_wires import GradientWire, WeightWire, ZeroPPOptions
from lightscale.patches.deepspeed import release_training_references
from lightscale.plugins.fsdp_precision import precision_name
from lightscale.plugins.precision_contract import (
    Compression,
    PrecisionRules,
    check_compression,
    enforce_contract,
    float8_refused,
    refuse_impossible,
)
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.class_info import SEVERAL_OPTIMIZERS
from lightscale.strategies.deepspeed.build import (
    construction_config,
    engine_config,
    engine_wraps,
    follow_engine,
    init_deepspeed_distributed,
    nvme_options,
    partitioned_construction,
    run_options,
    start_engine,
)
from lightscale.strategies.deepspeed.checkpoint import ZERO_WRITER
from lightscale.strategies.deepspeed.config import (
    ZeroOptions,
    check_clipping,
    check_zeropp_device,
    read_user_config,
    validate_user_config,
    writable_dir,
    zero_layout,
)
from lightscale.strategies.deepspeed.engine import (
    check_zero_optimizer,
    explain_partitioned_shapes,
    host_optimizer,
    not_a_boundary,
    refuse_moe,
    require_deepspeed,
)
from lightscale.strategies.deepspeed.portable_save import group_parameter_names
from lightscale.strategies.deepspeed.precision import DEEPSPEED_MEANINGS, FP16_NEEDS_CUDA, NO_FLOAT8
from lightscale.strategies.deepspeed.shards import ZeroShards
from lightscale.strategies.weight_averaging import adopt_weight_averaging

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
            The same three arguments as :class:`~lightscale.strategies.fsdp2.strategy.FSDP2Strategy`'s; on CPU they are
            refused when the Trainer is built (DeepSpeed's quantizer is a CUDA kernel).
        config: extra DeepSpeed engine options (a dict or a JSON file path). Keys the Trainer or the strategy
            already set, unknown keys and misplaced keys are errors.
        checkpoint_format: ``"dcp"`` (default) saves the portable layout every lightscale strategy loads, on any
            number of ranks (strategies/deepspeed/portable_save.py); ``"deepspeed"`` saves DeepSpeed's own engine
            directory (loads under ZeRO only). Either kind of directory is resumed, whatever this is set to.
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`.

    Example:
        >>> Trainer(strategy=ZeroStrategy(stage=3, offload_optimizer=True, config={"zero_optimization":
        ...     {"overlap_comm": True}}), accelerator="cpu", devices=2)
    """

    # DeepSpeed's engines: their own meaning of every precision but float8 (strategies/deepspeed/precision.py).
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
    tensor_shards = ZeroShards()  # a ZeRO-3 parameter is DeepSpeed's partition (strategies/deepspeed/shards.py)
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
    def memory_layout(self, world_size: int) -> Layout:
        """Stage 1 shards optimizer state, 2 gradients too, 3 parameters too; offload moves them to the host."""
        stage, offload_optimizer, offload_params = (
            self.options.stage,
            self.options.offload_optimizer,
            self.options.offload_params,
        )
        return zero_layout(type(self).__name__, world_size, stage, offload_optimizer, offload_params, self.user_config)

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """From the init parameters alone: `lightscale plan` and ``fit_memory`` describe ZeRO without DeepSpeed."""
        config = read_user_config(init_params.get("config"))
        stage, offload_optimizer = init_params.get("stage", 2), init_params.get("offload_optimizer", False)
        offload_params = init_params.get("offload_params", False)
        return zero_layout(cls.__name__, world_size, stage, offload_optimizer, offload_params, config)

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
        self.group_names: list[list[str]] = []
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
        init_deepspeed_distributed(self.process_group_backend)

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
        if not fitting and engine_wraps(self._engine, self.lightning_module):
            self.model, self.optimizers, self.lr_scheduler_configs = self._engine, [], []  # evaluate after fit
            return
        optimizer, scheduler = self._optimizer_and_scheduler(self.lightning_module) if fitting else (None, None)
        self.config = engine_config(
            self._run_options(trainer),
            trainer,
            self.lightning_module,
            optimizer,
            precision=self.precision_plugin.precision,
            compression=self.compression,
            user_config=self.user_config,
            processes_per_node=self.num_processes,
            fitting=fitting,
        )
        self.model = self._engine = start_engine(self.lightning_module, optimizer, self.config)
        follow_engine(self._engine, optimizer, scheduler.scheduler if scheduler is not None else None)
        self.optimizers = [self.model.optimizer] if fitting else []
        self.lr_scheduler_configs = [scheduler] if scheduler is not None else []
        if fitting:
            adopt_weight_averaging(trainer, self.lightning_module)
        self.barrier()

    @override
    def check_before_launch(self, trainer: Trainer) -> None:
        super().check_before_launch(trainer)
        self._check_trainer(trainer, precision_name(self.precision_plugin))
        if self._nvme_auto:
            writable_dir(Path(nvme_options(self.options, trainer, self.global_rank).nvme_path or "."))

    def _check_trainer(self, trainer: Trainer, precision: str) -> None:
        check_clipping(trainer)
        refuse_impossible(
            self.precision_rules, precision, device_type=self.root_device.type, compression=self.compression
        )

    def _run_options(self, trainer: Trainer) -> ZeroOptions:
        return run_options(self.options, trainer, self.global_rank, nvme_auto=self._nvme_auto)

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
        self.group_names = group_parameter_names(module, optimizer)
        if self.options.offload_optimizer:
            optimizer = host_optimizer(optimizer, self.user_config)
        return optimizer, schedulers[0] if schedulers else None

    @contextmanager
    @override
    def model_sharded_context(self):  # type: ignore[override]
        """Parameters created in ``configure_model`` are partitioned as they are built (stage 3)."""
        config = None
        if self.options.stage == 3:  # the offload path is checked before any work
            options = self._run_options(self.lightning_module.trainer)
            config = construction_config(options, user_config=self.user_config, processes_per_node=self.num_processes)
        with partitioned_construction(config):
            yield

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

    # ---- checkpoints: the engine's state, saved and loaded by its writer (deepspeed/checkpoint.py) ------------
    weights_settable_after_setup = False  # the engine builds its fp32 masters from the weights at setup
    checkpoint_writer = ZERO_WRITER

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the engine's state is saved by save_checkpoint; nothing is gathered here

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded by the engine in load_checkpoint

    @override
    def teardown(self) -> None:
        if self.model is not None and self.lightning_module is not None:
            self.model = self.lightning_module
        if self._engine is not None:  # kept for save_checkpoint and evaluation, but freed with the strategy
            release_training_references(self._engine)
        super().teardown()
