"""Running a pipeline: this rank's stages under a torch schedule, for training steps, evaluation and prediction.

torch's ``PipelineStage`` fixes the shapes it sends and receives at its first step (it infers them once and
allocates its receive buffers for them), so a stage can only run batches of the size it first ran. Hence:

* training runs one batch size, the first one (a loader's other batches are dropped before they reach the step,
  see ``parallel_3d``'s ``SplittableBatches``);
* evaluation and prediction run their own, forward-only, stages over the same modules, with their own fixed
  size (the first evaluation batch): other batches are cut into pieces of that size, the last one padded with
  copies of its last sample, and the padded rows' outputs are cut off again before the loss or the predictions
  are computed. So every sample counts once, whatever the batch sizes, and training shapes never mix with
  evaluation shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.layers.moe import load_not_counted
from lightscale.parallel.pipeline import check_microbatch_split, is_single_stage, schedule_class, stage_ids_owner
from lightscale.patches.torch_internals import wrap_stage_method

# torch runs these only with backward (their forward-only mode still executes backward actions).
SCHEDULES_WITHOUT_EVAL = frozenset({"zbv"})


class MicrobatchLoss:
    """The schedule's loss function: the module's ``loss_fn`` per microbatch, multiplied by the loss scale while a
    step sets one (the schedule runs backward from this value inside the step, so this is the only place an fp16
    loss scaler can scale what backward sees)."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.loss_fn = loss_fn
        self.scale: Callable[[Tensor], Tensor] | None = None

    def __call__(self, output: Tensor, target: Tensor) -> Tensor:
        loss = self.loss_fn(output, target)
        return loss if self.scale is None else self.scale(loss)


class Pipeline:
    """This rank's stages (``{stage index: module}``) and the named schedule over them, on ``pp_group``.

    ``step`` trains on a batch, ``evaluate`` returns a batch's loss and ``forward`` its outputs: each on every
    pipeline rank (broadcast from the rank holding the last stage).
    """

    def __init__(
        self,
        stage_modules: dict[int, nn.Module],
        *,
        schedule: str,
        num_stages: int,
        microbatches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        pp_group: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        self.stage_modules = stage_modules
        self.schedule_name = schedule
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.pp_group = pp_group
        self.device = device
        pp = dist.get_world_size(pp_group)
        self.owner_of = lambda stage: stage_ids_owner(stage, pp, v_shape=schedule == "zbv")  # pipeline rank
        self.last_stage_owner = dist.get_global_rank(pp_group, self.owner_of(num_stages - 1))
        self.has_first = 0 in stage_modules
        self.has_last = num_stages - 1 in stage_modules
        self.loss = MicrobatchLoss(loss_fn)
        self.schedule = self._schedule(self.loss)  # training: forward and backward of every microbatch
        self._forward_only: _PipelineSchedule | None = None  # evaluation and prediction, built on first use
        self.train_batch_size: int | None = None
        self.eval_batch_size: int | None = None

    def _schedule(self, loss_fn: MicrobatchLoss | None) -> _PipelineSchedule:
        stages = [
            PipelineStage(module, index, self.num_stages, self.device, group=self.pp_group)
            for index, module in self.stage_modules.items()
        ]
        for stage in stages:
            wrap_stage_method(stage, "_prepare_forward_infra", _load_not_counted)  # patches/torch_internals.py
        cls = schedule_class(self.schedule_name)
        return cls(stages[0] if is_single_stage(self.schedule_name) else stages, self.microbatches, loss_fn=loss_fn)

    # ---- training ----------------------------------------------------------------------------------------------
    def step(self, inputs: Tensor, targets: Tensor, *, loss_scale: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Forward and backward of every microbatch; the mean microbatch loss, unscaled. ``loss_scale`` (e.g.
        ``GradScaler.scale``) multiplies each microbatch loss before its backward."""
        size = inputs.shape[0]
        check_microbatch_split(size, self.microbatches)
        if self.train_batch_size is None:
            self.train_batch_size = size
        elif size != self.train_batch_size:
            raise ConfigurationError(
                f"A pipeline trains on one batch size (torch fixes its stages' shapes at the first step): got "
                f"{size} samples after {self.train_batch_size}. Use drop_last=True on the training loader."
            )
        losses: list[Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self.loss.scale = loss_scale
        try:
            self.schedule.step(*args, **kwargs, return_outputs=False)
        finally:
            self.loss.scale = None
        loss = (
            torch.stack([x.detach().float() for x in losses]).mean()
            if self.has_last
            else torch.zeros((), dtype=torch.float32)
        )
        loss = loss.to(inputs.device)
        if self.has_last and loss_scale is not None:
            loss = loss / loss_scale(torch.ones((), device=loss.device))  # exact: loss scales are powers of 2
        dist.broadcast(loss, src=self.last_stage_owner, group=self.pp_group)
        return loss

    # ---- evaluation and prediction -----------------------------------------------------------------------------
    def evaluate(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The module's loss on the whole batch (as one process computes it), forward-only."""
        outputs = self._forward(inputs)
        loss = (
            self.loss_fn(outputs, targets).detach().float()
            if outputs is not None
            else torch.zeros((), dtype=torch.float32)
        )
        loss = loss.to(inputs.device)
        dist.broadcast(loss, src=self.last_stage_owner, group=self.pp_group)
        return loss

    def forward(self, inputs: Tensor) -> Tensor:
        """The whole network's output for ``inputs`` (gathered if tensor-parallel), forward-only."""
        outputs = self._forward(inputs)
        if isinstance(outputs, DTensor):
            outputs = outputs.full_tensor()
        return self._from_last_stage(outputs, device=inputs.device)

    def _forward(self, inputs: Tensor) -> Tensor | None:
        """The last stage's outputs for ``inputs`` in pieces of the evaluation batch size; None on other ranks."""
        if self.schedule_name in SCHEDULES_WITHOUT_EVAL:
            return self._stage_by_stage(inputs)
        if self._forward_only is None:
            self._forward_only = self._schedule(None)
        size = inputs.shape[0]
        if self.eval_batch_size is None:
            self.eval_batch_size = size + (-size % self.microbatches)
        piece = self.eval_batch_size
        outputs: list[Tensor] = []
        with torch.no_grad():
            for start in range(0, size, piece):
                chunk = inputs[start : start + piece]
                padding = chunk[-1:].expand(piece - chunk.shape[0], *chunk.shape[1:])
                args = (torch.cat([chunk, padding]),) if self.has_first else ()
                output = self._forward_only.eval(*args)
                if self.has_last:
                    outputs.append(output[: chunk.shape[0]] if chunk.shape[0] < piece else output)
        if not self.has_last:
            return None
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _stage_by_stage(self, inputs: Tensor) -> Tensor | None:
        """Forward-only without a schedule: each stage in turn on the whole batch, its output sent to the rank of
        the next stage (shape and dtype first). No overlap between stages, but any batch size runs."""
        me = dist.get_rank(self.pp_group)
        owners = [self.owner_of(index) for index in range(self.num_stages)]
        hidden: Tensor | None = inputs
        with torch.no_grad():
            for index, module in sorted(self.stage_modules.items()):
                if index > 0 and owners[index - 1] != me:
                    hidden = self._receive(src=owners[index - 1], device=inputs.device)
                hidden = module(hidden)
                if index < self.num_stages - 1 and owners[index + 1] != me:
                    self._send(hidden, dst=owners[index + 1])
        return hidden if self.has_last else None

    def _send(self, tensor: Tensor, *, dst: int) -> None:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # each tp rank sends its own part
        dst = dist.get_global_rank(self.pp_group, dst)
        dist.send_object_list([(tuple(tensor.shape), tensor.dtype)], dst=dst, group=self.pp_group, device=tensor.device)
        dist.send(tensor.contiguous(), dst=dst, group=self.pp_group)

    def _receive(self, *, src: int, device: torch.device) -> Tensor:
        src = dist.get_global_rank(self.pp_group, src)
        meta: list[Any] = [None]
        dist.recv_object_list(meta, src=src, group=self.pp_group, device=device)
        shape, dtype = meta[0]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=src, group=self.pp_group)
        return tensor

    def _from_last_stage(self, value: Tensor | None, *, device: torch.device) -> Tensor:
        """``value`` (None but on the last stage) on every pipeline rank; its shape and dtype are sent first."""
        meta = [(tuple(value.shape), value.dtype) if value is not None else None]
        dist.broadcast_object_list(meta, src=self.last_stage_owner, group=self.pp_group, device=device)
        shape, dtype = meta[0]
        if value is None:
            value = torch.empty(shape, dtype=dtype, device=device)
        value = value.contiguous()
        dist.broadcast(value, src=self.last_stage_owner, group=self.pp_group)
        return value


class PipelinedNetwork(nn.Module):
    """Stands in for the whole network while the module predicts: calling it runs :meth:`Pipeline.forward`."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self.pipeline = pipeline  # not a Module: the stages stay registered where they are

    @override
    def forward(self, inputs: Tensor) -> Tensor:
        return self.pipeline.forward(inputs)


def share_stage_weights(
    network: nn.Module, stage_names: list[list[str]], *, owner_of: Callable[[int], int], pp_group: dist.ProcessGroup
) -> None:
    """Give every pipeline rank the weights of every stage: each stage's owner broadcasts its modules' parameters
    and buffers (DTensors gathered whole) over ``pp_group``, and the other ranks copy them into their own copies of
    those modules (which the pipeline never ran, so they still hold their initial values)."""
    me = dist.get_rank(pp_group)
    with torch.no_grad():
        for index, names in enumerate(stage_names):
            owner = owner_of(index)
            src = dist.get_global_rank(pp_group, owner)
            for name in names:
                module = network.get_submodule(name)
                tensors = sorted([*module.named_parameters(), *module.named_buffers()], key=lambda item: item[0])
                for _, tensor in tensors:
                    if me == owner:
                        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                        dist.broadcast(whole.detach().contiguous(), src=src, group=pp_group)
                    else:
                        received = torch.empty_like(tensor)
                        dist.broadcast(received, src=src, group=pp_group)
                        tensor.copy_(received)


def _load_not_counted(prepare: Callable[..., Any]) -> Callable[..., Any]:
    """torch infers stage shapes with one extra forward on the first step: not tokens an MoE router balances."""

    def prepare_uncounted(*args: Any, **kwargs: Any) -> Any:
        with load_not_counted():
            return prepare(*args, **kwargs)

    return prepare_uncounted
