"""``parallel_3d``: data x tensor x pipeline parallelism on DTensor, FSDP2 and ``torch.distributed.pipelining``.

The LightningModule supplies its parallelism through duck-typed hooks (the GPT recipe's GPTModule has them all):

    * ``parallelize(model, mesh, *, sequence_parallel, loss_parallel, reshard_after_forward)`` - apply TP then DP
      to the network or to one pipeline stage of it (``parallelize_gpt``); required when tp > 1 or dp > 1;
    * ``pipeline_stages(num_stages) -> list[list[str]]`` - module names of each stage; required when pp > 1;
    * ``loss_fn(output, target)`` - the loss of one microbatch, computed on the last stage; required when pp > 1;
    * ``validate_parallelism(*, tp, num_stages, sequence_parallel, loss_parallel)`` - optional, raises
      ConfigurationError before any model work.
The network is the module's ``.model`` attribute.

How a pipelined step fits Lightning's loop (training_step -> zero_grad -> backward -> optimizer_step): the
schedule runs forward *and* backward of every microbatch when the module's ``training_step`` calls
``self.loss(batch)`` - during the step the strategy serves ``loss`` from the pipeline and returns the batch loss,
broadcast from the last stage, on every rank, so ``self.log`` works unchanged. The gradients are set aside before
Lightning's ``zero_grad`` and put back in ``backward`` (scaled for gradient accumulation), where Lightning's
backward hooks still run. Clipping (by norm, over dp x tp x pp), LR schedulers and optimizer steps are Lightning's.
Validation runs the schedule forward-only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.parallel.grad_norm import clip_grad_norm_
from lightscale.parallel.pipeline import (
    Pipeline,
    build_pipeline,
    default_stages_per_rank,
    prune_to,
    schedule_class,
    stage_ids,
    validate_schedule,
)
from lightscale.plugins.distributed_checkpoint import load_sharded, save_sharded
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.mesh import ParallelDims

_META = {"trainer_state_name": "meta.ckpt"}  # Lightning's loop state beside the DCP shards


class Parallel3DStrategy(LightscaleStrategy):
    """Data, tensor and pipeline parallelism in one mesh ``(pp, dp_replicate, dp_shard, tp)``, tp innermost.

    Args:
        dp: data-parallel degree; ``-1`` infers it from the world size.
        tp: tensor-parallel degree (keep it inside a node: two collectives per layer).
        pp: pipeline-parallel degree (stages across nodes: one send per microbatch and stage).
        dp_mode: ``"shard"`` (FSDP2) or ``"replicate"`` (parameters replicated, gradients all-reduced).
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``interleaved_zb`` or ``zbv``.
        microbatches: microbatches per step (default: pp); the per-rank batch must divide into them.
        stages_per_rank: pipeline stages per rank (default 1, or 2 for interleaved and zero-bubble schedules).
        sequence_parallel: shard norm activations over the sequence between TP regions.
        loss_parallel: cross-entropy on vocabulary-sharded logits (no all-gather of the logits).
        **kwargs: see :class:`~lightscale.strategies.base.LightscaleStrategy`.

    Example:
        >>> Trainer(strategy=Parallel3DStrategy(tp=2, pp=2, schedule="interleaved_1f1b", microbatches=4), devices=8)
    """

    aliases = {
        "parallel_3d": ("dp x tp x pp: FSDP2 + tensor parallel + pipeline (here all dp)", {}),
        "tp2": ("tensor parallel over 2 ranks (sequence + loss parallel), the rest FSDP2", {"tp": 2}),
        "pp2": ("2 pipeline stages (1f1b, 2 microbatches), the rest FSDP2", {"pp": 2}),
        "tp2_pp2": ("tensor parallel 2 x pipeline 2 (1f1b), the rest FSDP2", {"tp": 2, "pp": 2}),
    }

    def __init__(
        self,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        dp_mode: Literal["shard", "replicate"] = "shard",
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if dp_mode not in ("shard", "replicate"):
            raise ConfigurationError(f"dp_mode must be 'shard' or 'replicate', got {dp_mode!r}.")
        for name, degree in (("dp", dp), ("tp", tp), ("pp", pp)):
            if (degree != -1 and degree < 1) or (name != "dp" and degree == -1):
                raise ConfigurationError(f"{name}={degree} is not valid: use a positive degree (dp may be -1).")
        schedule_class(schedule)  # unknown names fail here
        self.dp, self.tp, self.pp, self.dp_mode = dp, tp, pp, dp_mode
        self.schedule = schedule
        self.microbatches = microbatches if microbatches is not None else pp
        self.stages_per_rank = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
        if pp > 1:
            validate_schedule(schedule, pp=pp, microbatches=self.microbatches, stages_per_rank=self.stages_per_rank)
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.pipeline: Pipeline | None = None
        self._stashed_grads: list[tuple[Tensor, Tensor]] = []

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank if self.pp > 1 else 1

    @override
    def parallel_dims(self, world_size: int) -> ParallelDims:
        shard = self.dp_mode == "shard"
        return ParallelDims(
            world_size=world_size,
            dp_shard=self.dp if shard else 1,
            dp_replicate=1 if shard else self.dp,
            tp=self.tp,
            pp=self.pp,
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # validates the degrees against the world size
        module = self.lightning_module
        validate = getattr(module, "validate_parallelism", None)
        if validate is not None:
            validate(
                tp=self.tp,
                num_stages=self.num_stages,
                sequence_parallel=self.sequence_parallel,
                loss_parallel=self.loss_parallel,
            )
        needed = (["parallelize"] if self.dims.tp_enabled or self.dims.dp_enabled else []) + (
            ["pipeline_stages", "loss_fn", "loss"] if self.dims.pp_enabled else []
        )
        missing = [hook for hook in needed if not callable(getattr(module, hook, None))]
        if missing:
            raise ConfigurationError(
                f"{type(module).__name__} lacks the hooks {missing} that parallel_3d needs for {self.dims.describe()}; "
                "see lightscale/strategies/parallel_3d.py (GPTModule implements them all)."
            )

    # ---- applying parallelism ------------------------------------------------------------------------------
    @override
    def apply_parallelism(self, module: LightningModule) -> nn.Module:
        model: nn.Module = module.model
        if self.dims.pp_enabled:
            module.model = self._build_pipeline(module, model)
        elif self.dims.tp_enabled or self.dims.dp_enabled:
            self._parallelize(module, model)
        return module

    def _parallelize(self, module: LightningModule, model: nn.Module) -> None:
        module.parallelize(
            model,
            self.device_mesh,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            reshard_after_forward=not self.dims.pp_enabled,  # pipelines re-use weights across microbatches
        )

    def _build_pipeline(self, module: LightningModule, model: nn.Module) -> nn.Module:
        names = module.pipeline_stages(self.num_stages)
        all_names = [name for stage in names for name in stage]
        pp_mesh = self.device_mesh["pp"]
        ids = stage_ids(pp_mesh.get_local_rank(), self.pp, self.stages_per_rank, v_shape=self.schedule == "zbv")
        stages = {index: prune_to(model, names[index], all_names) for index in ids}
        for stage in stages.values():
            self._parallelize(module, stage)
        self.pipeline = build_pipeline(
            stages,
            schedule=self.schedule,
            num_stages=self.num_stages,
            microbatches=self.microbatches,
            loss_fn=module.loss_fn,
            pp_group=pp_mesh.get_group(),
            device=self.root_device,
        )
        # The module's view of its network: this rank's modules under their whole-model names (optimizer, checkpoint).
        return prune_to(model, [name for index in ids for name in names[index]], all_names)

    # ---- the step ------------------------------------------------------------------------------------------
    def _loss_parallel(self) -> AbstractContextManager:
        return loss_parallel() if self.dims.tp_enabled and self.loss_parallel else nullcontext()

    @contextmanager
    def _step_context(self, *, train: bool) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self._loss_parallel())
            if self.pipeline is not None:
                stack.enter_context(self._serve_pipeline_loss(train=train))
            yield

    @contextmanager
    def _serve_pipeline_loss(self, *, train: bool) -> Iterator[None]:
        module = self.lightning_module
        assert self.pipeline is not None and module is not None
        pipeline = self.pipeline

        def pipelined_loss(batch: tuple[Tensor, Tensor]) -> Tensor:
            inputs, targets = batch
            if not train:
                return pipeline.run(inputs, targets, train=False)
            params = list(module.parameters())
            held = [p.grad for p in params]  # earlier micro-steps' gradients (or stale ones zero_grad will clear)
            for param in params:
                param.grad = None
            loss = pipeline.run(inputs, targets, train=True)
            # Lightning calls zero_grad between training_step and backward: keep this step's gradients aside.
            self._stashed_grads = [(p, p.grad) for p in params if p.grad is not None]
            for param, grad in zip(params, held, strict=True):
                param.grad = grad
            return loss

        module.loss = pipelined_loss  # an instance attribute shadows the method for this step only
        try:
            yield
        finally:
            del module.loss

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context(train=True):
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context(train=False):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._step_context(train=False):
            return super().test_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            with self._loss_parallel():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward hooks
        self._restore_gradients(1.0 / self.lightning_module.trainer.accumulate_grad_batches)
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward hooks

    def _restore_gradients(self, scale: float) -> None:
        for param, grad in self._stashed_grads:
            if scale != 1.0:
                grad = grad * scale
            param.grad = grad if param.grad is None else param.grad + grad
        self._stashed_grads = []

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        # Lightning clips through the precision plugin; the norm must span dp x tp x pp, so clip here instead.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        pp_group = self.device_mesh["pp"].get_group() if self.dims.pp_enabled else None
        clip_grad_norm_(params, clip_val, pp_group=pp_group)

    # ---- checkpoints: torch.distributed.checkpoint, one shard file per rank ------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the sharded model and optimizer must exist before their shards can be loaded into them

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write ``filepath`` as a directory: DCP shards of model and optimizer from every rank, plus the rest of
        Lightning's checkpoint (loops, schedulers, callbacks) from rank 0 in ``meta.ckpt``; atomically."""
        path = Path(self.broadcast(str(filepath)))
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_sharded(path, self.lightning_module, self.optimizers, rest, self.checkpoint_io.save_checkpoint, **_META)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        load_sharded(path, self.lightning_module, self.optimizers, **_META)  # in place, into this rank's shards
        meta = self.checkpoint_io.load_checkpoint(path / _META["trainer_state_name"])
        return {**meta, "optimizer_states": []}  # restored above; Lightning only checks that the key exists

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded from the shards in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded from the shards in load_checkpoint
