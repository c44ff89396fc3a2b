"""Starting DeepSpeed for the ZeRO strategy: its process group, the engine config from the Trainer's settings, the
engine over the LightningModule, and ZeRO-3's partitioned construction. strategies/deepspeed/strategy.py stays the
Lightning-facing class and imports DeepSpeed only through this module (and the rest of its package).

Example:
    >>> init_deepspeed_distributed("gloo")  # after Lightning created torch's process group
    >>> engine = start_engine(module, optimizer, config)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.optim.lr_scheduler import LRScheduler

from lightscale.checkpoint.deepspeed_dir import safe_checkpoint_engine
from lightscale.optim.combined import CombinedOptimizer
from lightscale.optim.flat_muon import FlatMuon
from lightscale.optim.install import attach_flat, rebind_scheduler
from lightscale.patches.deepspeed import extensions_dir, replace_checkpoint_engine
from lightscale.strategies.deepspeed.config import ZeroOptions, build_config, micro_batch_size, writable_dir
from lightscale.strategies.deepspeed.engine import (
    EngineRoot,
    check_async_io,
    scalars_as_vectors,
    silence_deepspeed_noise,
)
from lightscale.strategies.deepspeed.partition import flat_groups, largest_parameter
from lightscale.strategies.deepspeed.portable_save import zero_optimizer


def init_deepspeed_distributed(backend: str) -> None:
    """Hand the process group Lightning created to DeepSpeed (it creates none of its own)."""
    # DeepSpeed JIT-builds its CPU ops (CPU Adam, shared-memory comm) once per virtual environment.
    extensions_dir()
    silence_deepspeed_noise()
    import deepspeed

    deepspeed.init_distributed(backend, dist_init_required=False)


def run_options(options: ZeroOptions, trainer: Trainer, rank: int, *, nvme_auto: bool) -> ZeroOptions:
    """The options of this run: ``zero_infinity`` by name swaps under the run's log dir; an NVMe path is checked
    (writable, DeepSpeed's async_io op builds) before any work."""
    options = nvme_options(options, trainer, rank) if nvme_auto else options
    if options.nvme_path:
        writable_dir(Path(options.nvme_path))
        check_async_io()
    return options


def nvme_options(options: ZeroOptions, trainer: Trainer, rank: int) -> ZeroOptions:
    # One swap directory per rank: ZeRO-Infinity file names are not unique across ranks of one machine.
    path = Path(trainer.log_dir or trainer.default_root_dir) / "zero_infinity_swap" / f"rank{rank}"
    return dataclasses.replace(options, offload_optimizer=True, offload_params=True, nvme_path=str(path))


def engine_config(
    options: ZeroOptions,
    trainer: Trainer,
    module: LightningModule,
    optimizer: torch.optim.Optimizer | None,
    *,
    precision: str,
    compression: str,
    user_config: dict[str, Any],
    processes_per_node: int,
    fitting: bool,
) -> dict[str, Any]:
    """The engine's config from what the Trainer, the strategy and the user's pass-through dict say."""
    config = build_config(
        options,
        micro_batch_size=micro_batch_size(trainer),
        accumulate=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        precision=precision,
        compression=compression,
        user_config=user_config,
        torch_optimizer_on_host=optimizer is not None and type(optimizer).__name__ != "DeepSpeedCPUAdam",
        processes_per_node=processes_per_node,
        largest_parameter=largest_parameter(module),
    )
    if not fitting and options.stage < 3:
        # Evaluation needs no optimizer, and ZeRO-1/2 partition only optimizer state and gradients: a plain
        # engine holds the (replicated) weights and still loads the checkpoint's module states.
        config["zero_optimization"] = {"stage": 0}
    return config


def construction_config(
    options: ZeroOptions, *, user_config: dict[str, Any], processes_per_node: int
) -> dict[str, Any]:
    """The config ``deepspeed.zero.Init`` partitions ``configure_model``'s parameters with (before the Trainer's
    batch size or precision matter)."""
    return build_config(
        options,
        micro_batch_size=1,
        accumulate=1,
        gradient_clip_val=None,
        precision="32-true",
        user_config=user_config,
        processes_per_node=processes_per_node,
    )


@contextmanager
def partitioned_construction(config: dict[str, Any] | None) -> Iterator[None]:
    """Parameters created inside are partitioned as they are built (ZeRO-3's ``deepspeed.zero.Init``); with
    ``config=None`` they are built whole."""
    import deepspeed

    with deepspeed.zero.Init(enabled=config is not None, config_dict_or_path=config):
        yield


def start_engine(module: LightningModule, optimizer: torch.optim.Optimizer | None, config: dict[str, Any]) -> Any:
    """DeepSpeed's engine over ``module`` (through :class:`EngineRoot`) stepping ``optimizer`` (None: evaluation)."""
    import deepspeed

    parameters = [p for p in module.parameters() if p.requires_grad]
    stage = config["zero_optimization"]["stage"]
    with scalars_as_vectors(module, stage=stage):  # DeepSpeed cannot start with 0-dim parameters; users keep them
        engine, *_ = deepspeed.initialize(
            model=EngineRoot(module),
            model_parameters=parameters if optimizer is not None else None,
            optimizer=optimizer,
            config=config,
            dist_init_required=False,
        )
    replace_checkpoint_engine(engine, safe_checkpoint_engine)  # resume loads weights-only
    return engine


def follow_engine(engine: Any, optimizer: torch.optim.Optimizer | None, scheduler: LRScheduler | None) -> None:
    """Tell the user's optimizer where each matrix (FlatMuon), each part (CombinedOptimizer) lies in the engine's flat
    partitions, and point the LR scheduler at the optimizer that steps (DeepSpeed's CPU Adam under offload)."""
    if isinstance(optimizer, (FlatMuon, CombinedOptimizer)):
        attach_flat(optimizer, flat_groups(zero_optimizer(engine)))
    if scheduler is not None:
        rebind_scheduler(scheduler, optimizer)  # type: ignore[arg-type]


def engine_wraps(engine: Any, module: LightningModule) -> bool:
    """Whether ``engine`` was started over ``module`` (evaluation after fit reuses it)."""
    root = getattr(engine, "module", None)
    return isinstance(root, EngineRoot) and root._lightning_module[0] is module
