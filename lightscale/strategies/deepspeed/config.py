"""The DeepSpeed config, generated from the Trainer and the strategy: one source of truth.

Whatever the Trainer already says (micro-batch size, ``accumulate_grad_batches``, ``gradient_clip_val``,
precision) and whatever the strategy name says (ZeRO stage, offload) is written here and may not be set again
in the user's pass-through ``config``. The user's dict may add engine options; a key that conflicts, that
DeepSpeed does not know, or that sits at the wrong level is an error naming the fix — never silently ignored.

Example:
    >>> build_config(ZeroOptions(stage=3, offload_optimizer=True, offload_params=True), micro_batch_size=8,
    ...              accumulate=1, gradient_clip_val=1.0, precision="bf16-mixed")["zero_optimization"]["stage"]
    3
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer

from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import DEEPSPEED_PERSISTENCE_THRESHOLD, Layout
from lightscale.parallel.fsdp_wires import ZeroPPOptions

# Keys the Trainer or the strategy owns, and where to set them instead.
OWNED_KEYS = {
    "train_batch_size": "the dataloader's batch size x accumulate_grad_batches x world size",
    "train_micro_batch_size_per_gpu": "the train dataloader's batch_size",
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "gradient_clipping": "Trainer(gradient_clip_val=...)",
    "fp16": "Trainer(precision='16-mixed')",
    "bf16": "Trainer(precision='bf16-mixed' or 'bf16-true')",
    "amp": "Trainer(precision=...)",
    "communication_data_type": "the strategy's compression=... (fp32 gradient reduction under mixed precision)",
    "optimizer": "LightningModule.configure_optimizers",
    "scheduler": "LightningModule.configure_optimizers (Lightning steps the scheduler)",
}
OWNED_ZERO_KEYS = {
    "stage": "the strategy name (zero1, zero2, zero3, ...)",
    "offload_optimizer": "the strategy name (zero2_offload, zero3_offload, zero_infinity) or its arguments",
    "offload_param": "the strategy name (zero3_offload, zero_infinity) or its arguments",
    "zero_quantized_weights": "the strategy's quantized_weights='int8' (ZeRO++ qwZ)",
    "zero_quantized_gradients": "the strategy's quantized_gradients='int4' (ZeRO++ qgZ)",
    "zero_hpz_partition_size": "the strategy's secondary_shard=N (ZeRO++ hpZ)",
}
# DeepSpeed's top-level config keys (deepspeed/runtime/constants.py and the config reference).
KNOWN_KEYS = set(OWNED_KEYS) | {
    "zero_optimization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "prescale_gradients",
    "gradient_predivide_factor",
    "seq_parallel_communication_data_type",
    "sparse_gradients",
    "aio",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "elasticity",
    "data_efficiency",
    "curriculum_learning",
    "checkpoint",
    "data_types",
    "memory_breakdown",
    "compression_training",
    "autotuning",
    "nebula",
    "pipeline",
    "compile",
    "timers",
    "dataloader_drop_last",
    "disable_allgather",
    "torch_autocast",
    "eigenvalue",
    "progressive_layer_drop",
    "quantize_training",
    "hybrid_engine",
    "use_data_before_expert_parallelism",
    "graph_harvesting",
    "sparse_attention",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
    "weight_quantization",
    "check_overflow",
    "managed_gradient_accumulation",
    "gradient_allreduce_op",
    "disable_python_gc",
    "zenflow",
}


@dataclass(frozen=True)
class ZeroOptions:
    """What the strategy name fixes: the stage and where optimizer state and parameters live."""

    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    nvme_path: str | None = None  # zero_infinity: offload to this directory instead of host memory
    zeropp: ZeroPPOptions = field(default_factory=ZeroPPOptions)  # ZeRO++ (qwZ, qgZ int4, hpZ): stage 3 on CUDA

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ConfigurationError(f"ZeRO stage={self.stage!r} is not valid; choose 1, 2 or 3.")
        check_deepspeed_zeropp(self.zeropp, self.stage)
        if self.offload_params and self.stage != 3:
            raise ConfigurationError(
                f"Parameter offload needs ZeRO stage 3 (parameters are only partitioned there), got stage "
                f"{self.stage}; use zero3_offload or offload_params=False."
            )


def check_deepspeed_zeropp(zeropp: ZeroPPOptions, stage: int) -> None:
    """Refuse the ZeRO++ settings DeepSpeed has no form of: any below stage 3, int8 gradients (its qgZ is int4)."""
    if zeropp.enabled and stage != 3:
        raise ConfigurationError(
            f"ZeRO++ (quantized_weights, quantized_gradients, secondary_shard) partitions parameters: it needs ZeRO "
            f"stage 3, got stage {stage}; use zero3, or fsdp2_zeropp."
        )
    if zeropp.gradients == "int8":
        raise ConfigurationError(
            "quantized_gradients='int8' is FSDP2's (fsdp2_zeropp); DeepSpeed's qgZ sends int4: choose 'none' or "
            "'int4' under zero3."
        )


def check_zeropp_device(zeropp: ZeroPPOptions, device_type: str) -> None:
    """Refuse ZeRO++ off CUDA: DeepSpeed's quantizer (``QuantizerBuilder``) is a CUDA kernel with no CPU build, and
    hpZ's secondary groups are counted in accelerator devices per node."""
    if zeropp.enabled and device_type != "cuda":
        raise ConfigurationError(
            f"ZeRO++ under zero3 (quantized_weights={zeropp.weights!r}, quantized_gradients={zeropp.gradients!r}, "
            f"secondary_shard={zeropp.secondary_shard!r}) runs DeepSpeed's CUDA quantizer, which has no build for "
            f"{device_type}. Run on CUDA GPUs, or use fsdp2_zeropp (the same wires in torch ops, on any device)."
        )


def zero_section(
    options: ZeroOptions, *, processes_per_node: int = 1, largest_parameter: int | None = None
) -> dict[str, Any]:
    """``largest_parameter`` (elements) sizes ZeRO-Infinity's parameter swap buffers to the model: DeepSpeed's
    default, 5 buffers of 1e8 elements, pins 2 GB of host memory per rank in fp32 whatever the model's size, and
    refuses (at the first swap) any parameter larger than a buffer."""
    section: dict[str, Any] = {"stage": options.stage}
    zeropp = options.zeropp
    if zeropp.weights != "none":
        section["zero_quantized_weights"] = True
    if zeropp.gradients != "none":
        section["zero_quantized_gradients"] = True
    if zeropp.secondary_shard is not None:
        node = zeropp.secondary_shard == "node"
        section["zero_hpz_partition_size"] = processes_per_node if node else zeropp.secondary_shard
    device = "nvme" if options.nvme_path else "cpu"
    target = {"device": device, **({"nvme_path": options.nvme_path} if options.nvme_path else {})}
    if options.offload_optimizer:
        section["offload_optimizer"] = dict(target)
    if options.offload_params:
        section["offload_param"] = dict(target)
        if options.nvme_path and largest_parameter is not None:
            section["offload_param"]["buffer_size"] = largest_parameter
    return section


def precision_section(precision: str, compression: str = "none") -> dict[str, Any]:
    """DeepSpeed's meaning of each Trainer precision (the contract row in lightscale/plugins/precision_contract.py).

    DeepSpeed would reduce in the parameters' dtype (bf16/fp16); the mixed modes reduce in fp32 as under every
    other strategy, unless ``compression`` asks for bf16/fp16.
    """
    engine: dict[str, Any]
    if precision in ("32-true", "32"):
        engine = {}
    elif precision in ("bf16-mixed", "bf16-true"):
        engine = {"bf16": {"enabled": True}}
    elif precision == "16-mixed":
        # loss_scale 0 = dynamic loss scaling, DeepSpeed's equivalent of torch's GradScaler.
        engine = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2}}
    else:
        raise ConfigurationError(
            f"precision={precision!r} is not supported by the ZeRO strategies; choose 32-true, bf16-mixed, "
            "bf16-true or 16-mixed."
        )
    reduce = compression if compression != "none" else ("fp32" if precision.endswith("-mixed") else None)
    return {**engine, **({"communication_data_type": reduce} if reduce else {})}


def build_config(
    options: ZeroOptions,
    *,
    micro_batch_size: int,
    accumulate: int,
    gradient_clip_val: float | None,
    precision: str,
    compression: str = "none",
    user_config: dict[str, Any] | None = None,
    torch_optimizer_on_host: bool = False,
    processes_per_node: int = 1,
    largest_parameter: int | None = None,
) -> dict[str, Any]:
    """The full engine config: the Trainer's and strategy's settings plus the user's validated extras.

    ``torch_optimizer_on_host``: the optimizer is not DeepSpeed's CPU Adam; under optimizer offload it steps the
    host partitions as itself, which DeepSpeed refuses unless ``zero_force_ds_cpu_optimizer`` is False.
    ``processes_per_node``: what ``secondary_shard="node"`` means (DeepSpeed's ``zero_hpz_partition_size``).
    ``largest_parameter``: the model's largest parameter in elements, where known (sizes NVMe swap buffers).
    """
    user = copy.deepcopy(user_config or {})
    validate_user_config(user)
    ours = zero_section(options, processes_per_node=processes_per_node, largest_parameter=largest_parameter)
    zero = {**user.pop("zero_optimization", {}), **ours}
    on_host = torch_optimizer_on_host and options.offload_optimizer
    return {
        # Any torch optimizer steps the ZeRO partitions (SGD, Lion, ...), as under Lightning's DeepSpeed strategy;
        # DeepSpeed otherwise asserts on every optimizer it did not write. The user's config may still say False.
        "zero_allow_untested_optimizer": True,
        **user,
        **({"zero_force_ds_cpu_optimizer": False} if on_host else {}),
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulate,
        "gradient_clipping": float(gradient_clip_val or 0.0),
        "zero_optimization": zero,
        "steps_per_print": user.get("steps_per_print", 2**31 - 1),  # Lightning logs; keep the engine quiet
        **precision_section(precision, compression),
    }


def validate_user_config(config: dict[str, Any]) -> None:
    """Reject keys that conflict with the Trainer/strategy, are unknown, or sit at the wrong level."""
    zero_keys = _zero_keys()
    for key in config:
        if key in OWNED_KEYS:
            raise ConfigurationError(
                f"DeepSpeed config key {key!r} is set by lightscale from {OWNED_KEYS[key]}; "
                "remove it from the strategy's config."
            )
        if key in zero_keys and key not in KNOWN_KEYS:
            raise ConfigurationError(
                f"DeepSpeed config key {key!r} belongs under 'zero_optimization', not at the "
                f"top level: {{'zero_optimization': {{{key!r}: ...}}}}."
            )
        if key not in KNOWN_KEYS:
            raise ConfigurationError(f"Unknown DeepSpeed config key {key!r}.{_closest(key, KNOWN_KEYS)}")
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigurationError(f"'zero_optimization' must be a dict of ZeRO options, got {zero!r}.")
    for key in zero:
        if key in OWNED_ZERO_KEYS:
            raise ConfigurationError(f"zero_optimization.{key} is set by {OWNED_ZERO_KEYS[key]}; remove it.")
        if key in KNOWN_KEYS:
            raise ConfigurationError(
                f"DeepSpeed config key {key!r} is a top-level key, not a "
                "'zero_optimization' option: move it up one level."
            )
        if key not in zero_keys:
            raise ConfigurationError(f"Unknown zero_optimization option {key!r}.{_closest(key, zero_keys)}")


def _zero_keys() -> set[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    return set(fields) | {f.alias for f in fields.values() if f.alias}


def _closest(key: str, valid: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(valid), n=1)
    return f" Did you mean {match[0]!r}?" if match else f" Valid keys: {sorted(valid)}."


def read_user_config(config: dict[str, Any] | str | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    path = Path(config)
    if not path.is_file():
        raise ConfigurationError(
            f"ZeroStrategy(config={config!r}): no such file. Valid: a dict of DeepSpeed options or the path of an "
            "existing JSON file."
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigurationError(f"ZeroStrategy(config={config!r}) is not valid JSON: {error}.") from error


def writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".lightscale_write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigurationError(f"Offload directory {path} is not writable ({error}); pass nvme_path=... .") from error
    return path


def check_clipping(trainer: Trainer) -> None:
    if trainer.gradient_clip_algorithm == "value" and trainer.gradient_clip_val:
        raise ConfigurationError(
            "gradient_clip_algorithm='value' is not valid under the ZeRO strategies: DeepSpeed clips gradients "
            "by norm only; use gradient_clip_algorithm='norm'."
        )


def micro_batch_size(trainer: Trainer) -> int:
    source = trainer.fit_loop._data_source
    if source.is_defined():
        loader = source.dataloader()
        batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        if batch_size:
            return batch_size
    return 1


def zero_layout(
    name: str, world_size: int, stage: int, offload_optimizer: bool, offload_params: bool, config: dict[str, Any]
) -> Layout:
    """The memory layout of a ZeRO stage (offload moves state to the host), from the options alone: `lightscale plan`
    and ``fit_memory`` describe ZeRO without DeepSpeed."""
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
