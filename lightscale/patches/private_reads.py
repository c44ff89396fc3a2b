"""Private names of torch, Lightning, DeepSpeed, torchao and litdata that lightscale reads or calls where it uses them
(the rebindings are in the other modules of this package). Each row is one ``Patch`` of scope ``read``: its target
``module:attribute.path`` must still resolve in the installed release (tests/unit/test_private_apis.py), and
``attributes`` rows pin private attributes read on upstream instances. pyproject.toml caps the versions tested.

Example:
    >>> read("torch._C", "_current_graph_task_id", "bucketed_ddp: one reduction per backward pass").target
    'torch._C:_current_graph_task_id'
"""

from __future__ import annotations

from lightscale.patches.table import Patch

CONNECTOR = "lightning.pytorch.trainer.connectors.checkpoint_connector"
# Lightning's checkpoint connector methods that restore a checkpoint (runtime/processes.py reads the same names)
RESTORING = ("resume_start", "restore", "_restore_modules_and_callbacks", "restore_training_state", "resume_end")


def read(module: str, path: str, used_for: str) -> Patch:
    """A private name lightscale reads or calls: ``module.path`` must resolve."""
    return Patch(f"{module}:{path}", "read", used_for, "a public equivalent")


PATCHES = [
    read("torch._C", "_current_graph_task_id", "bucketed_ddp: one reduction per backward pass"),
    read("torch.autograd", "Variable._execution_engine.queue_callback", "bucketed_ddp: finish after backward"),
    read("torch.distributed.distributed_c10d", "_get_default_store", "failure watch: errors reach every rank"),
    read("torch.distributed.checkpoint.filesystem", "_StorageInfo", "safe DCP loads: a type .metadata holds"),
    read("torch.distributed.checkpoint.filesystem", "FileSystemReader._get_metadata_path", "safe DCP loads"),
    read("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter", "checkpoints at fsspec URLs (s3://...)"),
    read("torch.distributed.checkpoint._fsspec_filesystem", "FsspecReader", "checkpoints at fsspec URLs (s3://...)"),
    read("torch.serialization", "_get_layout", "safe DCP loads: how .metadata names a layout"),
    read("torch.distributed._composable", "checkpoint", "activation checkpointing without wrapper modules"),
    read("torch.distributed.pipelining.schedules", "_Action", "pipeline schedule pictures and checks"),
    read("torch.distributed.pipelining.schedules", "_ComputationType", "pipeline schedule pictures and checks"),
    read("torch.distributed.pipelining._schedule_visualizer", "get_schedule_ops", "multi-stage schedule orders"),
    read("torch.distributed.pipelining.schedules", "_PipelineSchedule", "pipeline schedule types"),
    read("torch.distributed.pipelining.stage", "PipelineStage._prepare_forward_infra", "MoE load: no shape-inference"),
    read(
        "torch.distributed.device_mesh",
        "DeviceMesh._flatten",
        "expert and context parallelism: FSDP2 over dp x ep x cp",
    ),
    read("torch.distributed.device_mesh", "DeviceMesh._concatenate", "HSDP over (dp_replicate, dp_shard x cp)"),
    read("lightning.pytorch.trainer.trainer", "Trainer._results", "cp: values logged in a step reduced over cp"),
    read("lightning.fabric.utilities.types", "_Stateful", "stateful loaders: saved positions (loader_position.py)"),
    read("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher", "a stream's saved position skips the read-ahead"),
    read("litdata.utilities.env", "_DistributedEnv", "lightscale.streams.shard_litdata: litdata reads the data shard"),
    read("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection.log", "cp: logged values"),
    read("torch.distributed._functional_collectives", "all_to_all_single_autograd", "expert-parallel dispatch"),
    read("torch", "_grouped_mm", "MoE experts by grouped GEMM"),
    read("torchao.float8.float8_linear", "Float8Linear", "float8: converted layers"),
    read("torchao.float8.float8_tensor_parallel", "Float8ColwiseParallel", "float8 under tensor parallelism"),
    read("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu.default", "selective activation checkpointing"),
    read("torch", "ops.aten._scaled_dot_product_efficient_attention.default", "selective activation checkpointing"),
    read("torch", "ops.aten._scaled_dot_product_flash_attention.default", "selective activation checkpointing"),
    read("torch.distributed._composable.contract", "_get_registry", "MemoryProfiler: checkpointed units' kept inputs"),
    read("torch.cuda.memory", "_record_memory_history", "MemoryProfiler: allocator snapshots"),
    read("torch.cuda.memory", "_dump_snapshot", "MemoryProfiler: allocator snapshots"),
    read("torch._subclasses.fake_tensor", "FakeTensorMode", "estimate: a one-sample forward without memory"),
    read("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "Throughput: CPU attention FLOPs"),
    read("torch", "ops.aten._scaled_dot_product_flash_attention_backward", "cp ring/allgather blocks (CUDA)"),
    read("torch", "ops.aten._scaled_dot_product_efficient_attention_backward", "cp ring/allgather blocks (CUDA)"),
    read("torch", "ops.aten._scaled_dot_product_cudnn_attention", "cp ring/allgather blocks (CUDA)"),
    read("torch", "ops.aten._scaled_dot_product_cudnn_attention_backward", "cp ring/allgather blocks (CUDA)"),
    read("torch", "_fused_sdp_choice", "cp ring/allgather: the CUDA op SDPA itself would run"),
    read("lightning.fabric.utilities.distributed", "_init_dist_connection", "process group with a timeout"),
    read("lightning.fabric.utilities.distributed", "_sync_ddp_if_available", "Strategy.reduce"),
    read(
        "lightning.fabric.utilities.data", "_replace_dunder_methods", "re-created DataLoader subclasses keep arguments"
    ),
    read("lightning.fabric.utilities.optimizer", "_optimizers_to_device", "optimizer state placement"),
    read("lightning.fabric.strategies.registry", "_StrategyRegistry", "registering strategy names"),
    read("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher", "devices=N launches"),
    read("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher._call_children_scripts", "launcher pid"),
    read("lightning.pytorch.strategies.strategy", "_ForwardRedirection", "FSDP root hooks around training_step"),
    read("lightning.pytorch.core.optimizer", "_init_optimizers_and_lr_schedulers", "ZeRO: the user's optimizer"),
    read("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather", "ZeRO++: the quantized all-gather's base"),
    read(
        "torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter", "ZeRO++: the quantized reduce-scatter's base"
    ),
    read("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler._unscale_grads_", "MixedTensorGradScaler"),
    read("lightning.pytorch.callbacks.throughput_monitor", "_plugin_to_compute_dtype", "precision plugin dtype test"),
    read("lightning.pytorch.utilities.data", "_update_dataloader", "ExactlyOnceSampler replaces the padding sampler"),
    read("lightning.pytorch.core.saving", "pl_load", "load_from_checkpoint reads lightscale directories (hooked)"),
    read(
        "lightning.fabric.plugins.io.torch_io", "pl_load", "Lightning's Trainer reads lightscale directories (hooked)"
    ),
    read(
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector._check_config_and_set_final_flags",
        "unknown names in plain lightning.Trainer",
    ),
    read("lightning.pytorch.callbacks", "WeightAveraging._swap_models", "weight averaging of local shards"),
    read("lightning.pytorch.callbacks", "WeightAveraging._copy_average_to_current", "weight averaging of local shards"),
    *(
        read(CONNECTOR, f"_CheckpointConnector.{name}", "failure report: a failure below one of them is the restore")
        for name in RESTORING  # lightscale/runtime/processes.py RESTORING; a test checks they are the same
    ),
    read("torch.optim._muon", "_zeropower_via_newtonschulz", "Muon's Newton-Schulz in ShardedMuon and FlatMuon"),
    read("torch", "ops._c10d_functional.all_reduce", "CollectiveCounter: functional collectives by kind"),
    read("torch", "ops._c10d_functional_autograd.all_to_all_single", "CollectiveCounter: autograd collectives"),
    read("torch", "ops.c10d._allgather_base_", "CollectiveCounter: all_gather_into_tensor's op"),
    read("torch", "ops.c10d._reduce_scatter_base_", "CollectiveCounter: reduce_scatter_tensor's op"),
    read("torch", "ops.c10d.allreduce_.default._overloadpacket", "CollectiveCounter: an op's packet names its kind"),
    read("torch", "ScriptObject._type", "CollectiveCounter: a boxed ProcessGroup argument, by its type name"),
    read("torch", "UntypedStorage._cdata", "SavedTensors: one count per storage however many tensors share it"),
    read("torch", "Tensor._base", "SavedTensors: a view of a parameter is not an activation"),
    Patch(
        "DTensor._local_tensor",
        "read",
        "SavedTensors: the bytes a DTensor holds on this rank",
        "DTensor.to_local() without its autograd node",
        attributes=("torch.distributed.tensor._api:", ("_local_tensor",)),  # the module: inspect misses the class
    ),
    Patch(
        "FSDPModule._get_fsdp_state, FSDPState._is_root",
        "read",
        "an FSDP root whose forward was interrupted is reset before the next step (lightscale/parallel/fsdp.py)",
        "a public FSDPModule reset for an interrupted step",
        attributes=("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState", ("_is_root",)),
    ),
    read("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "FSDP roots reset after an interrupted forward"),
    Patch(
        "Strategy._forward_redirection",
        "read",
        "FSDP roots enter training_step through Lightning's redirection (lightscale/strategies/base.py)",
        "a public Strategy hook that runs a step inside the root module's forward",
        attributes=("lightning.pytorch.strategies.strategy:Strategy", ("_forward_redirection",)),
    ),
    Patch(
        "_FitLoop._data_source",
        "read",
        "ZeRO reads the micro-batch size from the training DataLoader before fit (strategies/deepspeed/config.py)",
        "a public accessor of the fit loop's data source",
        attributes=("lightning.pytorch.loops.fit_loop:_FitLoop", ("_data_source",)),
    ),
    read("lightning.fabric.utilities.seed", "_collect_rng_states", "fault-tolerant step: the random states it replays"),
    read("lightning.fabric.utilities.seed", "_set_rng_states", "fault-tolerant step: the random states it replays"),
    Patch(
        "LightningModule._trainer",
        "read",
        "whether the module is attached to a trainer, without Lightning's property raising when it is not "
        "(strategies/base.py, runtime/processes.py, strategies/parallel_3d/strategy.py, recipes/clip/module.py)",
        "a public LightningModule.has_trainer",
        attributes=("lightning.pytorch.core.module:LightningModule", ("_trainer",)),
    ),
    Patch(
        "LightningOptimizer._optimizer",
        "read",
        "the user's optimizer inside Lightning's wrapper (deepspeed/optimizer_tensors.py, strategies/shards.py, "
        "callbacks/memory_report.py)",
        "a public accessor of the wrapped optimizer",
        attributes=("lightning.pytorch.core.optimizer:LightningOptimizer", ("_optimizer",)),
    ),
    Patch(
        "ModelSummary._max_depth, _summarize_kwargs; Summary._model, _max_depth; LayerSummary._module",
        "read",
        "lightscale's ModelSummary counts global parameters: it replaces Lightning's callback with the same depth and "
        "arguments, and its Summary subclass reads the module and depth Lightning's __init__ stored "
        "(lightscale/callbacks/model_summary.py)",
        "a Summary hook for the parameter count (Lightning asks isinstance(strategy, DeepSpeedStrategy) itself)",
        attributes=("lightning.pytorch.callbacks.model_summary:ModelSummary", ("_max_depth", "_summarize_kwargs")),
    ),
    Patch(
        "ModelSummary internals: Summary._model, _max_depth, _forward_example_input",
        "read",
        "GlobalSummary.summarize is Lightning's summarize with global counts (lightscale/callbacks/model_summary.py)",
        "the same Summary hook",
        attributes=(
            "lightning.pytorch.utilities.model_summary.model_summary:ModelSummary",
            ("_model", "_max_depth", "_forward_example_input"),
        ),
    ),
    Patch(
        "LayerSummary._module",
        "read",
        "GlobalLayerSummary counts the layer's global parameters (lightscale/callbacks/model_summary.py)",
        "the same Summary hook",
        attributes=("lightning.pytorch.utilities.model_summary.model_summary:LayerSummary", ("_module",)),
    ),
    Patch(
        "_TrainingEpochLoop._batches_that_stepped (read and written)",
        "instance",
        "a fault-tolerant replica heals to a peer's step: the loggers' step counter travels with the model and the "
        "optimizer state and is set on the healed replica's epoch loop (lightscale/fault_tolerance/replica.py)",
        "a public loop state_dict that a peer's copy can be loaded from mid-epoch",
        attributes=("lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop", ("_batches_that_stepped",)),
    ),
    Patch(
        "_TrainingEpochLoop.automatic_optimization, manual_optimization",
        "read",
        "the heal reads and loads the optimization loops' progress (lightscale/fault_tolerance/replica.py)",
        "the same loop state_dict",
        attributes=(
            "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop",
            ("automatic_optimization", "manual_optimization"),
        ),
    ),
    Patch(
        "_AutomaticOptimization.optim_progress",
        "read",
        "the heal: the optimizer steps counted (trainer.global_step) as the peer's (lightscale/fault_tolerance/)",
        "the same loop state_dict",
        attributes=("lightning.pytorch.loops.optimization.automatic:_AutomaticOptimization", ("optim_progress",)),
    ),
    Patch(
        "_ManualOptimization.optim_step_progress",
        "read",
        "the heal under manual optimization: the steps counted as the peer's (lightscale/fault_tolerance/)",
        "the same loop state_dict",
        attributes=("lightning.pytorch.loops.optimization.manual:_ManualOptimization", ("optim_step_progress",)),
    ),
    Patch(
        "_FitLoop.epoch_progress, epoch_loop",
        "read",
        "the heal before the first epoch: the epoch as the peer's (lightscale/fault_tolerance/replica.py)",
        "the same loop state_dict",
        attributes=("lightning.pytorch.loops.fit_loop:_FitLoop", ("epoch_progress", "epoch_loop")),
    ),
    read("lightning.pytorch.loops.progress", "_BaseProgress.state_dict", "fault-tolerant heal: loop progress sent"),
    read("lightning.pytorch.loops.progress", "_OptimizationProgress.load_state_dict", "fault-tolerant heal"),
    read("lightning.pytorch.loops.progress", "_Progress.load_state_dict", "fault-tolerant heal: epoch progress"),
    Patch(
        "Module._parameters, _buffers, _non_persistent_buffers_set, _modules (aliased)",
        "instance",
        "ZeRO's engine root shares the LightningModule's state without registering it as a child: the same "
        "dictionaries, so checkpoint keys and parameters stay the module's (lightscale/strategies/deepspeed/engine.py)",
        "a DeepSpeed engine that accepts a forward callable besides the module whose parameters it manages",
        attributes=(
            "torch.nn.modules.module:Module",
            ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"),
        ),
    ),
]
