"""What ``parallel_3d`` does to the user's model: the checks before any work, the one parallelize path applied to the
whole module or to each pipeline stage, the pipeline built from the module's split, and the trained stages shared
back into every rank's whole network at the end.

Example:
    >>> build_pipeline(strategy, module, module.model)  # this rank's stages, parallelized, under a schedule
"""

from __future__ import annotations

from typing import Protocol

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightscale.errors import ConfigurationError
from lightscale.layers.moe import moe_layers
from lightscale.parallel.activation_checkpoint import ACMode
from lightscale.parallel.context_parallel import MODES as CP_MODES
from lightscale.parallel.contract import (
    check_hooks,
    has_hook,
    manual_optimization,
    network_of,
    sharding_units,
    tp_plan_of,
)
from lightscale.parallel.fsdp import contains_module
from lightscale.parallel.mesh import ParallelDims, axis
from lightscale.parallel.parallelize import ParallelizeOptions, parallelize_model
from lightscale.parallel.pipeline import prune_to, stage_ids, stage_ids_owner
from lightscale.parallel.pipeline_runtime import Pipeline, share_stage_weights
from lightscale.plugins.fsdp_precision import float8_options, mp_policy, precision_name
from lightscale.strategies.parallel_3d.context_parallel_step import check_context_parallel_model, predict_refusal
from lightscale.strategies.parallel_3d.pipeline_step import PipelinedModule


class Parallel3DStrategy(Protocol):
    """What these functions read of the strategy (strategy.py's ``Parallel3DStrategy``), named here rather than
    imported: the strategy module imports this one."""

    tp: int
    pp: int
    cp: int
    cp_mode: str
    schedule: str
    stages_per_rank: int
    microbatches: int
    sequence_parallel: bool
    loss_parallel: bool
    compression: str
    activation_checkpointing: ACMode
    compile: bool
    precision_plugin: Precision

    @property
    def dims(self) -> ParallelDims: ...
    @property
    def device_mesh(self) -> DeviceMesh: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def shards_data_parallel(self) -> bool: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def lightning_module(self) -> LightningModule: ...


def check_model(strategy: Parallel3DStrategy, module: LightningModule) -> None:
    """Refuse, before any model work, a module that lacks a hook these degrees need or that cp cannot split."""
    check_hooks(module, tp=strategy.tp, pp=strategy.pp)  # a missing plan fails here, naming the hook to write
    if has_hook(module, "validate_parallelism"):
        module.validate_parallelism(
            tp=strategy.tp,
            num_stages=strategy.num_stages,
            sequence_parallel=strategy.sequence_parallel,
            loss_parallel=strategy.loss_parallel,
        )
    if strategy.cp > 1:
        trainer = module.trainer
        if trainer.state.fn == TrainerFn.PREDICTING:
            raise ConfigurationError(predict_refusal(strategy.cp))
        block_size = getattr(trainer.datamodule, "block_size", None)  # a datamodule's declared sequence length
        length = block_size if isinstance(block_size, int) else None
        check_context_parallel_model(
            module, cp=strategy.cp, tp=strategy.tp, mode=strategy.cp_mode, sequence_length=length
        )


def parallelize_part(
    strategy: Parallel3DStrategy, module: LightningModule, root: nn.Module, units: list[nn.Module]
) -> None:
    """Parallelize ``root`` (the module's data-parallel root, or one pipeline stage) by the one path."""
    plan = None
    if strategy.dims.tp_enabled:
        plan = tp_plan_of(module, sequence_parallel=strategy.sequence_parallel, loss_parallel=strategy.loss_parallel)
    network = network_of(module) if root is module and not strategy.dims.pp_enabled else root  # a stage, a manual root
    policy = None  # no FSDP (dp = ep = 1 without a pipeline): autocast computes, nothing is reduced
    # Under a pipeline autocast computes and FSDP only reduces.
    if strategy.shards_data_parallel or strategy.dims.pp_enabled:
        name = precision_name(strategy.precision_plugin)
        policy = mp_policy(name, strategy.compression, cast_params=not strategy.dims.pp_enabled)
    options = ParallelizeOptions(
        activation_checkpointing=strategy.activation_checkpointing,
        compile=strategy.compile,
        mp_policy=policy,
        reshard_after_forward=not strategy.dims.pp_enabled,  # pipelines re-use weights across microbatches
        root_reshard_after_forward=manual_optimization(module) and not strategy.dims.pp_enabled,
        float8=float8_options(strategy.precision_plugin),
    )
    parallelize_model(
        root,
        strategy.device_mesh,
        units=units,
        options=options,
        network=network,
        tp_plan=plan,
        moe_layers=moe_layers(root),
    )


def build_pipeline(strategy: Parallel3DStrategy, module: LightningModule, model: nn.Module) -> PipelinedModule:
    """This rank's stages of ``model``, each parallelized, run by the chosen schedule."""
    names = module.pipeline_stages(strategy.num_stages)
    all_names = [name for stage in names for name in stage]
    pp_mesh = axis(strategy.device_mesh, "pp")
    v_shape = strategy.schedule == "zbv"
    ids = stage_ids(pp_mesh.get_local_rank(), strategy.pp, strategy.stages_per_rank, v_shape=v_shape)
    stages = {index: prune_to(model, names[index], all_names) for index in ids}
    units = sharding_units(module)
    for stage in stages.values():
        parallelize_part(strategy, module, stage, [unit for unit in units if contains_module(stage, unit)])
    pipeline = Pipeline(
        stages,
        schedule=strategy.schedule,
        num_stages=strategy.num_stages,
        microbatches=strategy.microbatches,
        loss_fn=module.loss_fn,
        pp_group=pp_mesh.get_group(),
        device=strategy.root_device,
    )
    return PipelinedModule(module, pipeline, names, ids)


def share_trained_stages(strategy: Parallel3DStrategy, network: nn.Module) -> None:
    """Every rank's network gets the weights of the stages other ranks ran (its own copies of those layers
    were never trained or loaded), so the whole network the user gets back holds the trained weights."""
    module = strategy.lightning_module
    v_shape = strategy.schedule == "zbv"
    share_stage_weights(
        network,
        module.pipeline_stages(strategy.num_stages),
        owner_of=lambda stage: stage_ids_owner(stage, strategy.pp, v_shape=v_shape),
        pp_group=axis(strategy.device_mesh, "pp").get_group(),
    )


def check_cp_options(cp: int, mode: str, *, compile: bool) -> None:
    """Refuse, at construction, a cp attention mode that does not exist and options cp does not compose with."""
    if mode not in CP_MODES:
        raise ConfigurationError(f"Unknown cp_mode {mode!r}; valid: {list(CP_MODES)}.")
    if cp > 1 and compile:
        raise ConfigurationError(
            f"cp={cp} with compile=True is not supported: context parallelism routes attention through a "
            "TorchFunctionMode and point-to-point collectives, which torch.compile'd blocks would graph-break around "
            "or bake out. Use compile=False with cp > 1, or cp=1."
        )
