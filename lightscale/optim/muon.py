"""torch.optim.Muon on DTensor shards: each matrix orthogonalized whole and once, by one owner rank.

Muon's momentum and weight decay are elementwise (each rank steps its shard); its Newton-Schulz iteration needs the
whole matrix. torch's own step runs it through DTensor's sharded matrix products, on every rank, rounded differently
from one process (its bf16 partial products are summed across the shards). Here, for a matrix whose rows are split
over one mesh dimension (fsdp2, hsdp's shard groups, parallel_3d's dp), the ranks of the shard group take turns
owning the matrices (round-robin): the owner gathers the bf16 momentum update (the first thing Newton-Schulz does is
that cast), runs the iteration exactly as one process, and scatters each rank its rows of the result. Per matrix of
M x N on W ranks, with P = ceil(M / W) rows per shard (padded): one gather and one scatter of P x N bf16 elements per
rank. Any other layout (tensor parallel's column shards) is gathered whole on every rank (``full_tensor``) and
orthogonalized there: exact, redundant. State: torch's ``momentum_buffer``, placed like the parameter.

The owner's gather, iteration and scatter (:func:`orthogonalize_splits`, on :class:`Split` pieces in rank order) are
shared with FlatMuon (lightscale/optim/flat_muon.py), whose pieces are runs of the flattened matrix in ZeRO's
partitions; the iteration is torch's own function.

Example:
    >>> optimizer = sharded_muon_from(torch.optim.Muon(matrices, lr=0.02))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz as zeropower_via_newtonschulz

from lightscale.optim.closure import closure_loss
from lightscale.optim.shard_sums import ShardLayout, layout_of, like_layout, local, local_grad


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` whose Newton-Schulz step runs once per matrix, whole, on its owner (module docstring)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        updates = [self._momentum_update(p, group) for p in params]
        ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["eps"])
        orthogonal = orthogonalize_sharded(params, updates, **ns)
        lr = float(group["lr"])  # a 1-element tensor lr too, as torch's
        for param, update in zip(params, orthogonal, strict=True):
            adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], param.shape)
            shard = local(param)
            shard.mul_(1 - lr * group["weight_decay"])
            shard.add_(update, alpha=-adjusted_lr)

    def _momentum_update(self, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """torch's momentum on this rank's shard: the buffer's lerp and the (Nesterov) update, bf16 as NS casts it."""
        grad = param.grad
        assert grad is not None
        if torch.is_complex(param) or grad.is_sparse or grad.ndim != 2:
            raise ValueError("Muon steps real, dense 2-D matrices only (torch.optim.Muon's rule).")
        state = self.state[param]
        if "momentum_buffer" not in state:  # placed like the parameter, whatever the gradient's placement
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        buf, shard = local(state["momentum_buffer"]), local_grad(param)
        buf.lerp_(shard, 1 - group["momentum"])
        update = shard.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return update.bfloat16()


def orthogonalize_sharded(
    params: list[torch.Tensor], updates: list[torch.Tensor], *, coefficients: tuple, steps: int, eps: float
) -> list[torch.Tensor]:
    """Each parameter's local rows of Newton-Schulz(update) of the whole matrix (bf16), computed once per matrix."""
    out: list[torch.Tensor | None] = [None] * len(params)
    splits: dict[int, Split] = {}
    for index, (param, update) in enumerate(zip(params, updates, strict=True)):
        layout = layout_of(param)
        group = _row_group(layout)
        if group is None:  # no split, or not rows over one mesh dimension: whole on every rank
            out[index] = _whole_then_local(update, layout, coefficients, steps, eps)
            continue
        splits[index] = Split(update, _row_sizes(layout.shape[0], dist.get_world_size(group)), layout.shape, group)
    done = orthogonalize_splits(list(splits.values()), coefficients=coefficients, steps=steps, eps=eps)
    for index, result in zip(splits, done, strict=True):
        out[index] = result
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class Split:
    """A matrix split over a process group's ranks along the first dimension of ``local``: rows (DTensor's Shard(0))
    or elements of the flattened matrix (ZeRO's flat partitions). Concatenating the ranks' pieces in rank order and
    viewing the result as ``shape`` gives the matrix."""

    local: torch.Tensor  # this rank's piece (bf16), ``sizes[rank]`` long in its first dimension
    sizes: list[int]  # each rank's piece length, in group rank order
    shape: torch.Size  # the whole matrix
    group: Any  # the process group


def orthogonalize_splits(
    splits: list[Split], *, coefficients: tuple, steps: int, eps: float, turns: dict[Any, int] | None = None
) -> list[torch.Tensor]:
    """This rank's piece of Newton-Schulz(matrix) for each split matrix, computed once per matrix by an owner rank.

    A matrix held whole by one rank is orthogonalized there, without communication. Every other matrix gets an owner
    (the group's ranks take turns, round-robin), which gathers the pieces, runs the iteration exactly as one process
    and scatters the pieces back: every gather is posted first, then each owner orthogonalizes, then every scatter is
    posted. Per matrix on W ranks: one gather and one scatter of max(sizes) elements per rank (pieces padded).
    ``turns`` (per process group, the next owner) carries the turns over calls: DeepSpeed steps one group at a time.
    """
    turns = {} if turns is None else turns
    pending: list[_Gather | tuple[Split, list[int]]] = []
    for split in splits:
        holders = [rank for rank, size in enumerate(split.sizes) if size > 0]
        if len(holders) == 1:  # whole on one rank (or an empty matrix): nothing to move
            pending.append((split, holders))  # orthogonalized below, while the gathers are in flight
            continue
        owner = turns.get(split.group, 0) % dist.get_world_size(split.group)
        turns[split.group] = owner + 1
        pending.append(_Gather(split, owner))
    scatters: list[_Scatter | torch.Tensor] = []
    for item in pending:
        if isinstance(item, tuple):
            scatters.append(_alone(*item, coefficients, steps, eps))
            continue
        whole = item.wait()
        result = None if whole is None else newton_schulz(whole, coefficients, steps, eps)
        scatters.append(_Scatter(result, item))
    return [item if isinstance(item, torch.Tensor) else item.wait() for item in scatters]


def _alone(split: Split, holders: list[int], coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    if not holders or dist.get_rank(split.group) != holders[0]:
        return split.local[:0]
    return newton_schulz(split.local.reshape(split.shape), coefficients, steps, eps).reshape(split.local.shape)


class _Gather:
    """This rank's piece (padded to the largest) posted to the owner; the owner's ``wait`` returns the matrix."""

    def __init__(self, split: Split, owner: int) -> None:
        self.split, self.owner, self.ranks = split, owner, dist.get_world_size(split.group)
        self.padded = max(split.sizes)
        padded = _padded(split.local, self.padded)
        self.is_owner = dist.get_rank(split.group) == owner
        self.pieces = [torch.empty_like(padded) for _ in range(self.ranks)] if self.is_owner else None
        self.request = dist.gather(padded, self.pieces, group=split.group, group_dst=owner, async_op=True)

    def wait(self) -> torch.Tensor | None:
        self.request.wait()
        if self.pieces is None:
            return None
        pieces = [piece[:size] for piece, size in zip(self.pieces, self.split.sizes, strict=True)]
        return torch.cat(pieces).reshape(self.split.shape)


class _Scatter:
    """The owner's result posted back: each rank receives its piece."""

    def __init__(self, result: torch.Tensor | None, gather: _Gather) -> None:
        split = gather.split
        rest = split.local.shape[1:]
        pieces = None
        if result is not None:
            flat = result.reshape(sum(split.sizes), *rest)
            pieces = [_padded(piece, gather.padded) for piece in flat.split(split.sizes)]
        self.mine = torch.empty((gather.padded, *rest), dtype=split.local.dtype, device=split.local.device)
        self.size = split.sizes[dist.get_rank(split.group)]
        self.request = dist.scatter(self.mine, pieces, group=split.group, group_src=gather.owner, async_op=True)

    def wait(self) -> torch.Tensor:
        self.request.wait()
        return self.mine[: self.size]


def _row_group(layout: ShardLayout) -> dist.ProcessGroup | None:
    """The process group of the one mesh dimension that splits rows (dim 0) and nothing else, or None."""
    mesh_dims = layout.mesh_dims_splitting(None)
    if layout.mesh is None or len(mesh_dims) != 1 or layout.mesh_dims_splitting([0]) != mesh_dims:
        return None
    return layout.mesh.get_group(mesh_dims[0])


def _row_sizes(rows: int, ranks: int) -> list[int]:
    """Rows each rank holds under Shard(0): torch.chunk's pieces, empty ones at the end (DTensor's split)."""
    sizes = [len(piece) for piece in torch.arange(rows).chunk(ranks)]
    return sizes + [0] * (ranks - len(sizes))


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    if rows.shape[0] == count:
        return rows.contiguous()
    return torch.cat([rows, rows.new_zeros((count - rows.shape[0], *rows.shape[1:]))])


def _whole_then_local(
    update: torch.Tensor, layout: ShardLayout, coefficients: tuple, steps: int, eps: float
) -> torch.Tensor:
    if layout.mesh is None:
        return newton_schulz(update, coefficients, steps, eps)
    whole = like_layout(update, layout, layout.placements, layout.shape).full_tensor()
    result = newton_schulz(whole, coefficients, steps, eps)
    return distribute_tensor(result, layout.mesh, layout.placements, src_data_rank=None).to_local()


def newton_schulz(matrix: torch.Tensor, coefficients: tuple, steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's own quintic Newton-Schulz iteration (bf16) on a whole matrix (pinned in
    tests/unit/test_private_apis.py): the same function one process runs."""
    return zeropower_via_newtonschulz(matrix, coefficients, steps, eps)


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment by the matrix's global shape."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def sharded_muon_from(optimizer: torch.optim.Muon) -> ShardedMuon:
    """A :class:`ShardedMuon` with ``optimizer``'s parameter groups, hyper-parameters and state."""
    sharded = ShardedMuon([dict(group) for group in optimizer.param_groups], **optimizer.defaults)
    sharded.state.update(optimizer.state)
    return sharded
