"""torch.optim.Adafactor's step on DTensor shards, exact as on whole parameters (the FSDP2 family, parallel_3d).

torch's Adafactor reads whole tensors: each matrix's row and column means of the squared gradient (its factored
second moment), the mean of the row statistics, and the norms of the parameter and of the update. On a DTensor its
in-place ops fail (``aten.pow_.Scalar: in-place operations that require placement changes``). Here each rank steps
its own shard and completes those statistics across the ranks that split them
(lightscale/optim/shard_sums.py): per step and parameter group one all-reduce of [parameter norms, column sums,
row-statistic sums] and one of the update norms, over the shard group (under fsdp2, whose shards split rows; a
split of columns, as tensor parallelism's, adds one for the row sums). The state is torch's (``step``, ``row_var``,
``col_var``, ``variance``, same shapes), held as DTensors placed like the parameter (a statistic's summed-away
dimension replicated), so checkpoints load under every strategy.

The strategy installs it in place of the user's ``torch.optim.Adafactor`` (:func:`sharded_adafactor_from`), with the
same parameter groups and hyper-parameters.

Example:
    >>> optimizer = sharded_adafactor_from(torch.optim.Adafactor(model.parameters(), lr=1e-2))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightscale.optim.closure import closure_loss
from lightscale.optim.shard_sums import ShardLayout, ShardSums, layout_of, like_layout, local, local_grad


@dataclass
class _Tensor:
    """One parameter's pieces during a step: local shards, its state, and the sums being completed."""

    param: torch.Tensor  # local shard
    grad: torch.Tensor  # local shard (negated under maximize)
    layout: ShardLayout
    state: dict[str, Any]
    param_sq: torch.Tensor
    row_sq: torch.Tensor | None = None
    col_sq: torch.Tensor | None = None
    row_total: torch.Tensor | None = None
    update: torch.Tensor | None = None
    update_sq: torch.Tensor | None = None
    alpha: float = 0.0  # the step size before the update's clipping, from the parameter's norm

    @property
    def factored(self) -> bool:
        return len(self.layout.shape) > 1


class ShardedAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` whose step completes its statistics across DTensor shards (module docstring)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        eps1, eps2 = group["eps"]
        tensors = [self._start(p, group) for p in group["params"] if p.grad is not None]
        if not tensors:
            return
        eps1 = torch.finfo(tensors[0].param.dtype).eps if eps1 is None else eps1  # torch's: the first parameter's
        lr, beta2_decay = float(group["lr"]), group["beta2_decay"]  # a 1-element tensor lr too, as torch's
        steps = [_advance(t.state["step"]) for t in tensors]
        first, second, third = ShardSums(), ShardSums(), ShardSums()
        for t, step in zip(tensors, steps, strict=True):
            _first_sums(t, first, one_minus_beta2=step**beta2_decay)
        first.reduce()
        for t, step in zip(tensors, steps, strict=True):
            _second_sums(t, second, one_minus_beta2=step**beta2_decay)
        second.reduce()
        for t, step in zip(tensors, steps, strict=True):
            numel = math.prod(t.layout.shape)
            rho = min(lr, 1 / step**0.5)
            t.alpha = max(eps2, t.param_sq.item() ** 0.5 / numel**0.5) * rho
            if group["weight_decay"] != 0:
                t.param.mul_(1 - lr * group["weight_decay"])
            _update(t, third, eps1=eps1, one_minus_beta2=step**beta2_decay)
        third.reduce()
        for t in tensors:
            numel = math.prod(t.layout.shape)
            assert t.update is not None and t.update_sq is not None
            denom = max(1.0, t.update_sq.item() ** 0.5 / (numel**0.5 * group["d"]))
            t.param.add_(t.update, alpha=-t.alpha / denom)

    def _start(self, param: torch.Tensor, group: dict[str, Any]) -> _Tensor:
        if torch.is_complex(param):
            raise RuntimeError("Adafactor does not support complex parameters")
        grad = param.grad
        assert grad is not None
        if grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients")
        layout, state = layout_of(param), self.state[param]
        if len(state) == 0:
            state.update(_initial_state(param, layout))
        shard = local_grad(param)
        shard = -shard if group["maximize"] else shard
        local_param = local(param)
        return _Tensor(local_param, shard, layout, state, local_param.float().square().sum().reshape(1))


def _initial_state(param: torch.Tensor, layout: ShardLayout) -> dict[str, Any]:
    """torch's state (same keys and global shapes), each statistic placed like the parameter."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's step dtype
    state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=scalar)}
    shard = local(param)
    if param.dim() > 1:
        for key, dim in (("row_var", -1), ("col_var", -2)):
            shape = list(param.shape)
            shape[dim] = 1
            local_shape = list(shard.shape)
            local_shape[dim] = 1
            zeros = shard.new_zeros(local_shape)
            state[key] = like_layout(zeros, layout, layout.placements_without(dim), torch.Size(shape))
    else:
        state["variance"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _advance(step: torch.Tensor) -> float:
    step += 1
    return step.item()


def _first_sums(t: _Tensor, first: ShardSums, *, one_minus_beta2: float) -> None:
    """Parameter norm and the squared gradient's row/column sums; a row statistic already whole is updated now and
    its column sum joins the first reduction (under fsdp2's row shards: one all-reduce for all of them)."""
    first.add(t.param_sq, t.layout, dims=None)
    if not t.factored:
        return
    square = t.grad.float().square()
    t.row_sq = first.add(square.sum(-1, keepdim=True), t.layout, dims=[-1])
    t.col_sq = first.add(square.sum(-2, keepdim=True), t.layout, dims=[-2])
    if not t.layout.mesh_dims_splitting([-1]):  # rows whole on this rank: row_var is final before any reduction
        t.row_total = first.add(_update_rows(t, one_minus_beta2), t.layout, dims=[-2])


def _second_sums(t: _Tensor, second: ShardSums, *, one_minus_beta2: float) -> None:
    if not t.factored:
        return
    assert t.col_sq is not None
    local(t.state["col_var"]).lerp_(t.col_sq.div_(t.layout.shape[-2]).to(t.param.dtype), one_minus_beta2)
    if t.row_total is None:  # rows split across ranks (tensor parallel): their sums were completed first
        t.row_total = second.add(_update_rows(t, one_minus_beta2), t.layout, dims=[-2])


def _update_rows(t: _Tensor, one_minus_beta2: float) -> torch.Tensor:
    """row_var <- lerp(row_var, mean of g^2 over the row); returns its local sum over rows (for the row mean)."""
    assert t.row_sq is not None
    row_var = local(t.state["row_var"])
    row_var.lerp_(t.row_sq.div(t.layout.shape[-1]).to(t.param.dtype), one_minus_beta2)
    return row_var.float().sum(-2, keepdim=True)


def _update(t: _Tensor, third: ShardSums, *, eps1: float, one_minus_beta2: float) -> None:
    """torch's update on the local shard: rsqrt of the (factored) second moment times the gradient."""
    if t.factored:
        assert t.row_total is not None
        row_var, col_var = local(t.state["row_var"]), local(t.state["col_var"])
        row_mean = (t.row_total / t.layout.shape[-2]).to(t.param.dtype)
        var_estimate = (row_var @ col_var).div_(row_mean.clamp_(min=eps1))
    else:
        variance = local(t.state["variance"])
        variance.lerp_(t.grad * t.grad, one_minus_beta2)
        var_estimate = variance.clone()
    t.update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(t.grad)
    t.update_sq = third.add(t.update.float().square().sum().reshape(1), t.layout, dims=None)


def sharded_adafactor_from(optimizer: torch.optim.Adafactor) -> ShardedAdafactor:
    """A :class:`ShardedAdafactor` with ``optimizer``'s parameter groups, hyper-parameters and state."""
    sharded = ShardedAdafactor([dict(group) for group in optimizer.param_groups], **optimizer.defaults)
    sharded.state.update(optimizer.state)
    return sharded
