"""The private APIs of torch, Lightning and DeepSpeed that lightscale relies on still exist where we use them.

Private names move between releases without notice; pyproject.toml caps the versions tested, and this test fails
naming the API (listed in docs/architecture.md, "Private APIs and versions") when an upgrade moves one.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import torch

from lightscale.patches import Patch, all_patches
from lightscale.runtime.processes import RESTORING

PRIVATE_APIS = [
    # (module, attribute path, who uses it)
    ("torch._C", "_current_graph_task_id", "bucketed_ddp: one reduction per backward pass"),
    ("torch.autograd", "Variable._execution_engine.queue_callback", "bucketed_ddp: finish after backward"),
    ("torch.distributed.distributed_c10d", "_get_default_store", "failure watch: errors reach every rank"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "safe DCP loads: a type .metadata holds"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader._get_metadata_path", "safe DCP loads"),
    ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter", "checkpoints at fsspec URLs (s3://...)"),
    ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader", "checkpoints at fsspec URLs (s3://...)"),
    ("torch.serialization", "_get_layout", "safe DCP loads: how .metadata names a layout"),
    ("torch.distributed._composable", "checkpoint", "activation checkpointing without wrapper modules"),
    ("torch.distributed.pipelining.schedules", "_Action", "pipeline schedule pictures and checks"),
    ("torch.distributed.pipelining.schedules", "_ComputationType", "pipeline schedule pictures and checks"),
    ("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops", "multi-stage schedule orders"),
    ("torch.distributed.pipelining.schedules", "_PipelineSchedule", "pipeline schedule types"),
    ("torch.distributed.pipelining.stage", "PipelineStage._prepare_forward_infra", "MoE load: no shape-inference"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", "expert and context parallelism: FSDP2 over dp x ep x cp"),
    ("torch.distributed.device_mesh", "DeviceMesh._concatenate", "HSDP over (dp_replicate, dp_shard x cp)"),
    ("lightning.pytorch.trainer.trainer", "Trainer._results", "cp: values logged in a step reduced over cp"),
    ("lightning.fabric.utilities.types", "_Stateful", "stateful loaders: saved positions (loader_position.py)"),
    ("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher", "a stream's saved position skips the read-ahead"),
    ("litdata.utilities.env", "_DistributedEnv", "lightscale.streams.shard_litdata: litdata reads the data shard"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection.log", "cp: logged values"),
    ("torch.distributed._functional_collectives", "all_to_all_single_autograd", "expert-parallel dispatch"),
    ("torch", "_grouped_mm", "MoE experts by grouped GEMM"),
    ("torchao.float8.float8_linear", "Float8Linear", "float8: converted layers"),
    ("torchao.float8.float8_tensor_parallel", "Float8ColwiseParallel", "float8 under tensor parallelism"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu.default", "selective activation checkpointing"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention.default", "selective activation checkpointing"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention.default", "selective activation checkpointing"),
    ("torch.distributed._composable.contract", "_get_registry", "MemoryProfiler: checkpointed units' kept inputs"),
    ("torch.cuda.memory", "_record_memory_history", "MemoryProfiler: allocator snapshots"),
    ("torch.cuda.memory", "_dump_snapshot", "MemoryProfiler: allocator snapshots"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode", "estimate: a one-sample forward without memory"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "Throughput: CPU attention FLOPs"),
    ("torch", "ops.aten._scaled_dot_product_flash_attention_backward", "cp ring/allgather blocks (CUDA)"),
    ("torch", "ops.aten._scaled_dot_product_efficient_attention_backward", "cp ring/allgather blocks (CUDA)"),
    ("torch", "ops.aten._scaled_dot_product_cudnn_attention", "cp ring/allgather blocks (CUDA)"),
    ("torch", "ops.aten._scaled_dot_product_cudnn_attention_backward", "cp ring/allgather blocks (CUDA)"),
    ("torch", "_fused_sdp_choice", "cp ring/allgather: the CUDA op SDPA itself would run"),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection", "process group with a timeout"),
    ("lightning.fabric.utilities.distributed", "_sync_ddp_if_available", "Strategy.reduce"),
    ("lightning.fabric.utilities.data", "_replace_dunder_methods", "re-created DataLoader subclasses keep arguments"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device", "optimizer state placement"),
    ("lightning.fabric.strategies.registry", "_StrategyRegistry", "registering strategy names"),
    ("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher", "devices=N launches"),
    ("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher._call_children_scripts", "launcher pid"),
    ("lightning.pytorch.strategies.strategy", "_ForwardRedirection", "FSDP root hooks around training_step"),
    ("lightning.pytorch.core.optimizer", "_init_optimizers_and_lr_schedulers", "ZeRO: the user's optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.set_gradient_accumulation_boundary", "ZeRO accumulation"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather", "ZeRO++: the quantized all-gather's base"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter", "ZeRO++: the quantized reduce-scatter's base"),
    ("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.load", "weights-only"),
    ("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint", "lightscale export (ZeRO)"),
    ("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler._unscale_grads_", "MixedTensorGradScaler"),
    ("lightning.pytorch.callbacks.throughput_monitor", "_plugin_to_compute_dtype", "precision plugin dtype test"),
    ("lightning.pytorch.utilities.data", "_update_dataloader", "ExactlyOnceSampler replaces the padding sampler"),
    ("lightning.pytorch.core.saving", "pl_load", "load_from_checkpoint reads lightscale directories (hooked)"),
    ("lightning.fabric.plugins.io.torch_io", "pl_load", "Lightning's Trainer reads lightscale directories (hooked)"),
    (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector._check_config_and_set_final_flags",
        "unknown names in plain lightning.Trainer",
    ),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state", "ZeRO DCP"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.update_lp_params", "ZeRO DCP: bit16 copies"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.get_full_hp_param", "ZeRO DCP: safe_get_full_*"),
    ("lightning.pytorch.callbacks", "WeightAveraging._swap_models", "weight averaging of local shards"),
    ("lightning.pytorch.callbacks", "WeightAveraging._copy_average_to_current", "weight averaging of local shards"),
    ("deepspeed.utils", "safe_set_full_optimizer_state", "ZeRO DCP load (public, checked for 0.19.x)"),
    ("deepspeed.utils", "safe_set_local_fp32_param", "ZeRO-3 DCP load: this rank's padded piece (public)"),
    ("deepspeed.utils", "safe_set_local_optimizer_state", "ZeRO-3 DCP load: this rank's padded piece (public)"),
    *(
        ("lightning.pytorch.trainer.connectors.checkpoint_connector", f"_CheckpointConnector.{name}", "failure report")
        for name in RESTORING  # a failure below one of them is reported as the restore, not as the stage to come
    ),
    ("torch.optim._muon", "_zeropower_via_newtonschulz", "Muon's Newton-Schulz in ShardedMuon and FlatMuon"),
]


OPTIONAL = {"deepspeed", "torchao", "litdata"}  # extras of pyproject.toml, not dependencies


def _resolve(module: str, path: str) -> object:
    value: object = importlib.import_module(module)
    for name in path.split("."):
        value = getattr(value, name)
    return value


@pytest.mark.parametrize(("module", "path", "used_for"), PRIVATE_APIS, ids=[f"{m}.{p}" for m, p, _ in PRIVATE_APIS])
def test_private_api_exists(module: str, path: str, used_for: str) -> None:
    if module.split(".")[0] in OPTIONAL:  # `make test`'s venv has every extra; a `make compat` venv may lack one
        pytest.importorskip(module.split(".")[0])
    try:
        _resolve(module, path)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{module}.{path} (used for: {used_for}) moved or vanished: {error}. See docs/architecture.md.")


def test_fsdp2_custom_comm_hooks_keep_their_signatures() -> None:  # lightscale/parallel/zeropp.py implements them
    import inspect

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    assert list(inspect.signature(AllGather.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "async_op"
    ]  # fmt: skip
    assert list(inspect.signature(ReduceScatter.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "op", "async_op"
    ]  # fmt: skip
    assert list(inspect.signature(AllGather.allocate).parameters) == ["self", "size", "dtype", "device"]
    assert callable(FSDPModule.set_custom_all_gather) and callable(FSDPModule.set_custom_reduce_scatter)


def test_lightning_strategies_redirect_forward() -> None:  # FSDP roots enter training_step through it
    from lightning.pytorch.strategies import SingleDeviceStrategy

    assert callable(SingleDeviceStrategy("cpu")._forward_redirection), "Strategy._forward_redirection moved"


@pytest.mark.parametrize(
    ("pattern", "used_for"),
    [
        ("self._config", "ZeRO: its checkpoint engine is rebuilt weights-only from engine._config"),
        ("self.optimizer._restore_from_bit16_weights()", "ZeRO-3 evaluation stubs it on the offload stand-in"),
        ("elif hasattr(p, 'ds_optim_param'):", "ZeRO-0/1/2: 0-dim parameters skip the start-up broadcast by this mark"),
    ],
)
def test_deepspeed_engine_internals(pattern: str, used_for: str) -> None:
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine

    assert pattern in inspect.getsource(DeepSpeedEngine), f"DeepSpeedEngine no longer uses {pattern} ({used_for})"


@pytest.mark.parametrize(
    "attribute",
    [
        "single_partition_of_fp32_groups",
        "real_dp_process_group",
        "partition_size",
        "round_robin_bit16_meta",
        "round_robin_bit16_offsets",
        "bit16_groups_flat",
    ],
)
def test_zero12_flat_layout_attributes(attribute: str) -> None:  # lightscale/zero/partition.py flat_groups (FlatMuon)
    import inspect

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    source = inspect.getsource(DeepSpeedZeroOptimizer)
    assert f"self.{attribute}" in source, f"ZeRO-1/2 no longer keeps {attribute}: flat_groups reads the layout from it"
    assert "self.optimizer.param_groups = [original_param_groups[group_no]]" in source  # one group per inner step


@pytest.mark.parametrize("attribute", ["fp32_partitioned_groups_flat", "sub_group_process_groups", "fp16_groups"])
def test_zero3_flat_layout_attributes(attribute: str) -> None:  # lightscale/zero/partition.py flat_groups (FlatMuon)
    import inspect

    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    source = inspect.getsource(DeepSpeedZeroOptimizer_Stage3)
    assert f"self.{attribute}" in source, f"ZeRO-3 no longer keeps {attribute}: flat_groups reads the layout from it"
    assert "start = start + src.ds_numel" in source  # each parameter's partition laid end to end in a sub-group
    assert "def partition_numel" in inspect.getsource(Init)  # the per-rank piece, ceil(numel / ranks)


def test_zero3_gathers_to_ds_shape() -> None:  # lightscale/zero/engine.py scalars_as_vectors sets it back to []
    import inspect

    from deepspeed.runtime.zero import partition_parameters

    source = inspect.getsource(partition_parameters)
    assert "param.ds_shape = param.shape" in source and ".view(param.ds_shape)" in source
    assert "dist.broadcast(param.data.view(torch.uint8)" in source  # why 0-dim parameters start as [1]


def test_zero_to_fp32_loads_through_its_torch_global() -> None:  # export swaps that global for weights-only loads
    from deepspeed.utils import zero_to_fp32

    assert zero_to_fp32.torch is torch, "deepspeed.utils.zero_to_fp32.torch moved: export would load unsafely"


def test_fit_loop_keeps_its_data_source() -> None:  # ZeRO reads the micro-batch size from it
    from lightning.pytorch import Trainer

    loop = Trainer(accelerator="cpu", devices=1, logger=False).fit_loop
    assert hasattr(loop, "_data_source") and hasattr(loop._data_source, "is_defined")


def test_fsdp_state_says_whether_its_root_ran_forward() -> None:  # lightscale/parallel/fsdp.py reset_interrupted_roots
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert hasattr(FSDPModule, "_get_fsdp_state")
    assert FSDPState()._is_root is None  # set by the lazy init of the first forward


def test_graph_task_id_outside_backward() -> None:
    assert torch._C._current_graph_task_id() == -1  # bucketed_ddp relies on -1 outside a backward pass


def test_pipeline_schedules_take_scale_grads() -> None:
    import inspect

    from torch.distributed.pipelining.schedules import _PipelineSchedule

    assert "scale_grads" in inspect.signature(_PipelineSchedule.__init__).parameters  # 1/microbatches scaling


# ---- every upstream patch (lightscale/patches/): wrapped signatures and private attributes, pinned ----------------
def _resolve_target(target: str) -> object:
    module, _, qualname = target.partition(":")
    return _resolve(module, qualname)


_PATCHES = all_patches()


@pytest.mark.parametrize("patch", [p for p in _PATCHES if p.signature], ids=[p.target for p in _PATCHES if p.signature])
def test_wrapped_callable_keeps_its_parameters(patch: Patch) -> None:
    target, names = patch.signature  # type: ignore[misc]
    found = tuple(inspect.signature(_resolve_target(target)).parameters)
    assert found[: len(names)] == names, f"{target} now takes {found}; lightscale relies on {names} ({patch.why})"


@pytest.mark.parametrize(
    "patch", [p for p in _PATCHES if p.attributes], ids=[p.target for p in _PATCHES if p.attributes]
)
def test_private_attributes_are_still_used_upstream(patch: Patch) -> None:
    owner, names = patch.attributes  # type: ignore[misc]
    source = "".join(_source(cls) for cls in inspect.getmro(_resolve_target(owner)))
    missing = [name for name in names if f".{name}" not in source]
    assert not missing, f"{owner} no longer has {missing} ({patch.why}); see lightscale/patches/"


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # builtins, generics
        return ""


def test_only_the_patches_package_rebinds_upstream_names() -> None:
    """No mock in the package, no instance method shadowed and no environment written outside lightscale/patches/
    (lightscale's own LIGHTSCALE_* variables aside)."""
    root = Path(__file__).resolve().parents[2] / "lightscale"
    found = []
    for path in root.rglob("*.py"):
        if "patches" in path.parts:
            continue
        text = path.read_text()
        found += [f"{path.name}: {word}" for word in ("unittest", "MethodType", "environ.setdefault") if word in text]
        found += [
            f"{path.name}: os.environ[...] ="
            for line in text.splitlines()
            if "os.environ[" in line and "] =" in line and "LAUNCHER" not in line
        ]
    assert not found, found


def test_architecture_page_lists_every_patch() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    assert not [p.target for p in _PATCHES if f"`{p.target}`" not in page]
