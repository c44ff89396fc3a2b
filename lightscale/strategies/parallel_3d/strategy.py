"""``parallel_3d``: data x tensor x pipeline parallelism on DTensor, FSDP2 and ``torch.distributed.pipelining``.

The LightningModule tells it how to split through the model contract (lightscale/parallel/contract.py): a TP plan
for tp > 1, a pipeline split and a microbatch loss for pp > 1; with only dp it needs nothing. Every stage (or the
whole module) is parallelized by the one path, lightscale/parallel/parallelize.py: TP, activation checkpointing,
compile, FSDP2 - so ``parallel_3d`` with only dp and ``fsdp2`` run the same program.

How a pipelined step fits Lightning's loop is parallel_3d/pipeline_step.py: the schedule runs forward *and*
backward of every microbatch when the module's ``training_step`` calls ``self.loss(batch)``; the batch loss,
broadcast from the last stage, is returned on every rank, so ``self.log`` works unchanged. Clipping (by norm, over
dp x tp x pp: the precision plugin's, lightscale/plugins/fsdp_precision.py), LR schedulers and optimizer steps are
Lightning's. Validation, test and predict run a forward-only schedule (lightscale/parallel/pipeline_runtime.py).

Context parallelism (``cp > 1``) changes no module: each step's batch is cut along the sequence and the model's SDPA
calls are routed across the cp ranks while the step runs (and when checkpointed blocks are recomputed in backward);
lightscale/strategies/parallel_3d/context_parallel_step.py and docs/strategies/context_parallel.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any, Literal

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.estimate.memory_layout import Layout
from lightscale.estimate.plan import Plannable
from lightscale.layers.moe import moe_layers
from lightscale.parallel.activation_checkpoint import ACMode, check_ac_mode
from lightscale.parallel.context_parallel import Mode as CPMode
from lightscale.parallel.contract import data_parallel_roots, sharding_units
from lightscale.parallel.experts import check_expert_parallel
from lightscale.parallel.mesh import ParallelDims, check_degrees, context_parallel_group, pipeline_group
from lightscale.parallel.parallelize import apply_to_roots
from lightscale.parallel.pipeline import (
    default_stages_per_rank,
    schedule_class,
    validate_schedule,
)
from lightscale.parallel.pipeline_runtime import Pipeline
from lightscale.plugins.fsdp_precision import float8_options, parallel_3d_precision_plugin, precision_name
from lightscale.plugins.precision_contract import (
    FLOAT8_CPU,
    Compression,
    PrecisionRules,
    check_compression,
    enforce_contract,
    float8_refused,
)
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.class_info import init_arguments
from lightscale.strategies.parallel_3d.context_parallel_step import (
    ContextParallelStep,
    check_context_parallel_moe,
)
from lightscale.strategies.parallel_3d.layout import LAYOUT_SETTINGS, dims_of, parallel_3d_layout
from lightscale.strategies.parallel_3d.model import (
    build_pipeline,
    check_cp_options,
    check_model,
    parallelize_part,
    share_trained_stages,
)
from lightscale.strategies.parallel_3d.pipeline_step import PipelinedModule, SplittableBatches


class Parallel3DStrategy(LightscaleStrategy):
    """Data, tensor, pipeline, expert and context parallelism in one mesh ``(pp, dp_replicate, dp_shard, ep, cp,
    tp)``, tp innermost.

    Args:
        dp: data-parallel degree; ``-1`` infers it from the world size.
        tp: tensor-parallel degree (keep it inside a node: two collectives per layer).
        pp: pipeline-parallel degree (stages across nodes: one send per microbatch and stage).
        ep: expert-parallel degree: MoE experts sharded over ``ep`` ranks carved from the data-parallel ones
            (each sees its own batch; tokens travel to their experts by all-to-all). See docs/strategies/moe.md.
        cp: context-parallel degree: each sample's sequence sharded over ``cp`` ranks that read the same samples,
            attention computed across them for any model calling ``F.scaled_dot_product_attention``; FSDP2 shards
            over ``dp x cp``. See docs/strategies/context_parallel.md.
        cp_mode: how attention crosses the cp ranks: ``"ring"`` (K/V passed around, overlapped), ``"allgather"``
            (K/V gathered once per layer) or ``"ulysses"`` (all-to-all to head shards; heads per tp rank divide by cp).
        dp_mode: ``"shard"`` (FSDP2) or ``"replicate"`` (parameters replicated, gradients all-reduced).
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zb`` or ``zbv``.
        microbatches: microbatches per step (default: pp); the per-rank batch must divide into them.
        stages_per_rank: pipeline stages per rank (default 1, or 2 for interleaved and zero-bubble schedules).
        sequence_parallel: shard norm activations over the sequence between TP regions.
        loss_parallel: cross-entropy on vocabulary-sharded logits (no all-gather of the logits).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``, per sharding unit (after TP).
        compile: ``torch.compile`` each sharding unit (after TP and checkpointing, before FSDP).
        compression: ``"bf16"``/``"fp16"`` reduce data-parallel gradients in that dtype instead of fp32, the same
            option as ``bucketed_ddp``'s (docs/plugins/precision.md); with dp = ep = 1 there is nothing to reduce.
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`.

    Example:
        >>> Trainer(strategy=Parallel3DStrategy(tp=2, pp=2, schedule="interleaved_1f1b", microbatches=4), devices=8)
    """

    # The standard meanings: FSDP's policy where FSDP shards the whole module, else autocast (a scaler on all ranks).
    precision_rules = PrecisionRules(
        "parallel_3d",
        how={
            "bf16-mixed": "as fsdp2 when FSDP shards the whole module (dp or ep > 1, no pipeline); else bf16 autocast",
            "16-mixed": "as fsdp2 when FSDP shards the whole module; else fp16 autocast + ShardedGradScaler "
            "(all ranks; under a pipeline each microbatch loss is scaled inside the schedule)",
        },
        refused=float8_refused(FLOAT8_CPU, devices=("cpu",)),
    )
    parameter_view = "dtensor"  # the optimizer steps DTensor shards (lightscale/optim/rule.py)
    aliases = {
        "parallel_3d": ("dp x tp x pp: FSDP2 + tensor parallel + pipeline (here all dp)", {}),
        "tp2": ("tensor parallel over 2 ranks (sequence + loss parallel), the rest FSDP2", {"tp": 2}),
        "pp2": ("2 pipeline stages (1f1b, 2 microbatches), the rest FSDP2", {"pp": 2}),
        "tp2_pp2": ("tensor parallel 2 x pipeline 2 (1f1b), the rest FSDP2", {"tp": 2, "pp": 2}),
        "ep2": ("MoE experts sharded over 2 ranks (all-to-all), the rest FSDP2 over all ranks", {"ep": 2}),
        "ep2_pp2": ("MoE expert parallel 2 x pipeline 2 (1f1b), the rest FSDP2", {"ep": 2, "pp": 2}),
        "ep2_tp2": ("MoE expert parallel 2 x tensor parallel 2, the rest FSDP2", {"ep": 2, "tp": 2}),
        "cp2": (
            "context parallel over 2 ranks: sequences sharded, attention by ring (any SDPA model), FSDP2 over dp x cp",
            {"cp": 2},
        ),
        "cp2_tp2": ("context parallel 2 x tensor parallel 2, the rest FSDP2", {"cp": 2, "tp": 2}),
    }
    plannable = (  # the degrees come from the aliases
        Plannable.of(
            aliases,
            "cp2",
            "3Ψ + K/V ring/layer",
            "+ sequences split over 2 ranks (activations / 2)",
            activation_checkpointing="full",
        ),
        Plannable.of(
            aliases,
            "tp2",
            "3Ψ/2 + 4bsh/layer",
            "+ tensor parallel over 2 ranks (layers split)",
            activation_checkpointing="full",
        ),
    )

    @override
    def memory_layout(self, world_size: int) -> Layout:
        """Dense states sharded by FSDP2 over dp_shard x ep x cp, layers split over tp, stages over pp, sequences over
        cp (activations)."""
        return type(self).layout_for(world_size, **{name: getattr(self, name) for name in LAYOUT_SETTINGS})

    @classmethod
    @override
    def layout_for(cls, world_size: int, **init_params: Any) -> Layout:
        """As ``memory_layout`` answers, from the parameters."""
        return parallel_3d_layout(cls.__name__, world_size, init_arguments(cls, init_params))

    reads_single_files = False

    def __init__(
        self,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
        cp_mode: CPMode = "ring",
        dp_mode: Literal["shard", "replicate"] = "shard",
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        activation_checkpointing: ACMode = "none",
        compile: bool = False,
        compression: Compression = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        check_ac_mode(activation_checkpointing)
        check_compression(compression, self.precision_rules)
        self.compression = compression
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self._parallelized: LightningModule | None = None
        self.pipelined: PipelinedModule | None = None  # the module's network as this rank's pipeline stages
        self.context_parallel: ContextParallelStep | None = None  # cp > 1: the step's sharding and attention
        if dp_mode not in ("shard", "replicate"):
            raise ConfigurationError(f"dp_mode must be 'shard' or 'replicate', got {dp_mode!r}.")
        check_degrees({"dp": dp, "tp": tp, "pp": pp, "ep": ep, "cp": cp}, inferable=["dp"])  # at construction
        if ep > 1 and dp_mode == "replicate":
            raise ConfigurationError("ep > 1 shards the dense part with FSDP2 over dp x ep: use dp_mode='shard'.")
        check_cp_options(cp, cp_mode, compile=compile)
        schedule_class(schedule)  # unknown names fail here
        self.dp, self.tp, self.pp, self.ep, self.cp, self.dp_mode = dp, tp, pp, ep, cp, dp_mode
        self.cp_mode = cp_mode
        self.schedule = schedule
        self.microbatches = microbatches if microbatches is not None else pp
        self.stages_per_rank = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
        if pp > 1:
            validate_schedule(schedule, pp=pp, microbatches=self.microbatches, stages_per_rank=self.stages_per_rank)
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel

    @property
    def pipeline(self) -> Pipeline | None:
        return self.pipelined.pipeline if self.pipelined is not None else None

    @override
    def checkpoint_module(self) -> nn.Module:
        """Checkpoints hold what this rank trains: its pipeline stages, under the whole model's names."""
        pipelined = self.pipelined
        return pipelined.checkpoint_view if pipelined is not None else super().checkpoint_module()

    @property
    def whole_network(self) -> nn.Module | None:
        """The user's whole network while ``module.model`` is this rank's pipeline stages, else None."""
        pipelined = self.pipelined
        return pipelined.network if pipelined is not None and pipelined.module.model is pipelined.stages else None

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @override
    def parallel_dims(self, world_size: int) -> ParallelDims:
        return dims_of(world_size, self.dp, self.dp_mode, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # validates the degrees against the world size
        check_model(self, self.lightning_module)

    # ---- applying parallelism ------------------------------------------------------------------------------
    @property
    def shards_data_parallel(self) -> bool:
        """FSDP applies to the whole LightningModule (no pipeline, dp x ep x cp > 1): precision is then FSDP's
        policy."""
        return self.dims.fsdp_size > 1 and not self.dims.pp_enabled

    @override
    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        if self._parallelized is module:  # validate/test after fit: the same shards (and pipeline) again
            if self.pipelined is not None:
                self.pipelined.attach()
            if self.context_parallel is not None:
                self.context_parallel.attach()
            return module
        self._parallelized = module
        if self.dims.ep_enabled:
            check_expert_parallel(moe_layers(module), self.ep)
        if self.dims.cp_enabled:
            check_context_parallel_moe(module, cp=self.cp)
            group = context_parallel_group(self.device_mesh)
            self.context_parallel = ContextParallelStep(module, group, mode=self.cp_mode)
        # The same roots as under fsdp2 (same program for the same degrees); a pipeline parallelizes its stages.
        self._roots = [] if self.dims.pp_enabled else self._data_parallel_roots(module)
        parallelize = partial(parallelize_part, self, module)
        apply_to_roots(module, self._roots, sharding_units(module), parallelize)  # placed by model_to_device
        if self.dims.pp_enabled:
            self.pipelined = build_pipeline(self, module, module.model)
            self.pipelined.attach()
        return module

    def _data_parallel_roots(self, module: LightningModule) -> list[nn.Module]:
        """Several roots (manual optimization, several networks) take one TP/EP plan of the whole module: refused."""
        roots = data_parallel_roots(module, strategy=type(self).__name__)
        if len(roots) > 1 and (self.dims.tp_enabled or self.dims.ep_enabled):
            raise ConfigurationError(
                f"Parallel3DStrategy(tp={self.tp}, ep={self.ep}) with manual optimization (automatic_optimization="
                f"False) and several child networks of {type(module).__name__}: each network becomes its own FSDP "
                "root, but the tensor/expert plan covers the whole module. Use tp=1 and ep=1 (dp only), or one "
                "network child (self.model) holding every parameter."
            )
        return roots

    # ---- the step ------------------------------------------------------------------------------------------
    def _loss_parallel(self) -> AbstractContextManager:
        return loss_parallel() if self.dims.tp_enabled and self.loss_parallel else nullcontext()

    @contextmanager
    @override
    def step_context(self, step: str) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self._loss_parallel())
            if self.context_parallel is not None:
                trainer = self.lightning_module.trainer
                stack.enter_context(self.context_parallel.serving(trainer, self.reduce))
            if self.pipelined is not None:
                scaler = getattr(self.precision_plugin, "scaler", None)  # fp16: scales each microbatch loss
                loss_scale = scaler.scale if scaler is not None else None
                stack.enter_context(self.pipelined.serving(step, loss_scale=loss_scale))
            yield

    @override
    def call_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Under cp the step gets this rank's tokens of the batch (hooks and callbacks see the data shard's)."""
        if self.context_parallel is None or not args:
            return super().call_step(step, *args, **kwargs)
        batch, *rest = args
        output = super().call_step(step, self.context_parallel.shard(batch), *rest, **kwargs)
        if step == "training_step":
            self.context_parallel.check_attention_called()
        return output

    @property
    @override
    def trains_short_batches(self) -> bool:
        return not self.dims.pp_enabled

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Under a pipeline, training batches of another size than the first (an epoch's partial last batch) are
        dropped before they reach the step, with a warning: torch's stages run one shape. Evaluation and predict
        take any batch (see lightscale/parallel/pipeline_runtime.py). Lightning's sampler is replaced first (the
        base strategy), which already drops an epoch's remainder under a pipeline, with a warning naming it."""
        dataloader = super().process_dataloader(dataloader)
        if not self.dims.pp_enabled or not self.lightning_module.trainer.training:
            return dataloader
        return SplittableBatches(dataloader, lambda: self.pipeline, self.microbatches)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions as one process gives them, on every rank: DTensors gathered whole, and under a pipeline the
        module's call of its network (``module.model(inputs)``) runs the schedule forward-only."""
        return apply_to_collection(super().predict_step(*args, **kwargs), DTensor, DTensor.full_tensor)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipelined is None:
            with self._loss_parallel():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module  # the schedule ran backward in training_step: its gradients come back here
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward hooks
        self.pipelined.restore_gradients(1.0 / module.trainer.accumulate_grad_batches)
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward hooks

    @override
    def configure_precision(self, plugin: Precision) -> Precision:
        name = precision_name(plugin)
        emulate = bool(float8 := float8_options(plugin)) and float8.emulate
        device, compression = self.root_device.type, self.compression
        enforce_contract(self.precision_rules, name, device_type=device, compression=compression, emulate=emulate)
        if self.compression != "none" and self.dims.fsdp_size == 1:
            rank_zero_warn(f"compression={self.compression!r} has no effect: dp = ep = cp = 1, no gradient is reduced.")
        # FSDP casts per unit (MixedPrecisionPolicy) exactly as under fsdp2 when it wraps the whole module; clipping
        # by norm spans dp x tp x pp.
        pp_group = pipeline_group(self.device_mesh)
        return parallel_3d_precision_plugin(
            name, self.root_device.type, fsdp_casts=self.shards_data_parallel, pp_group=pp_group, given=plugin
        )

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        network = self.whole_network
        if module is not None and network is not None:
            trainer = module._trainer
            if trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED:  # no collectives on errors
                share_trained_stages(self, network)
            self.pipelined.detach()  # the user's network object again, not this rank's pipeline stages
        if self.context_parallel is not None:
            self.context_parallel.detach()  # the Hugging Face models' position hooks
        super().teardown()
