"""The collectives of context parallelism, each an autograd function whose backward is its transpose.

- :func:`ring_shift`: every rank sends a tensor to the next rank of the group and receives the previous rank's
  (point-to-point, ``batch_isend_irecv``); backward sends the gradient back the other way. The forward is
  asynchronous: it returns the receive buffer at once and :class:`Pending` waits for it, so the caller can
  compute on the current block meanwhile.
- :func:`all_gather_sequence`: the group's tensors concatenated in rank order along ``dim``; backward is a
  reduce-scatter of the gradient (each rank gets the sum of every rank's gradient for its own block).
- :func:`all_to_all_heads`: sequence shards to head shards (``(B, H, S/cp, D)`` -> ``(B, H/cp, S, D)``, the
  sequence in rank order) and :func:`all_to_all_sequence` back; each is the other's backward.

Written here rather than taken from ``torch.distributed.nn.functional`` because that module's all-gather backward
emulates reduce-scatter on gloo with ``cp`` scatters, and its functions are deprecated.

Example:
    >>> pending = Pending()
    >>> k_next = ring_shift(k, group, pending)  # in flight
    >>> ...  # compute with k
    >>> pending.wait()  # k_next is now the previous rank's k
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

# torch 2.13 deprecates the *_tensor names; older torch has only them.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Pending:
    """Point-to-point requests started by :func:`ring_shift` and not yet waited for."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()


def _exchange(x: Tensor, group: ProcessGroup, *, step: int) -> tuple[Tensor, list[Any]]:
    """Send ``x`` to the rank ``step`` ahead in the group, receive from the one ``step`` behind; not waited."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    received = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, group=group, group_peer=(rank + step) % size),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - step) % size),
    ]
    return received, dist.batch_isend_irecv(ops)


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, pending: Pending) -> Tensor:
        ctx.group = group
        received, works = _exchange(x.contiguous(), group, step=1)
        pending.works.extend(works)
        return received

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # The gradient of what this rank received belongs to the rank it came from: the previous one.
        received, works = _exchange(grad.contiguous(), ctx.group, step=-1)
        for work in works:
            work.wait()
        return received, None, None


def ring_shift(x: Tensor, group: ProcessGroup, pending: Pending) -> Tensor:
    """The previous rank's ``x`` (valid after ``pending.wait()``); gradients flow back to the sender."""
    return _RingShift.apply(x, group, pending)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        size = dist.get_world_size(group)
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
        _ALL_GATHER(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        size = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        _REDUCE_SCATTER(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def all_gather_sequence(x: Tensor, group: ProcessGroup, *, dim: int = -2) -> Tensor:
    """Every rank's ``x`` concatenated in rank order along ``dim``; backward reduce-scatters the gradient."""
    return _AllGather.apply(x, group, dim % x.dim())


def _all_to_all(x: Tensor, group: ProcessGroup, split_dim: int, cat_dim: int) -> Tensor:
    """Split ``x`` into ``cp`` parts along ``split_dim``, part ``i`` to rank ``i``; received parts joined on
    ``cat_dim`` in rank order."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=split_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=cat_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, split_dim: int, cat_dim: int) -> Tensor:
        ctx.args = (group, split_dim, cat_dim)
        return _all_to_all(x, group, split_dim, cat_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        group, split_dim, cat_dim = ctx.args
        return _all_to_all(grad, group, cat_dim, split_dim), None, None, None


def all_to_all_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    """``(B, H, S_local, D)`` sequence shards -> ``(B, H / cp, cp * S_local, D)`` head shards (rank order)."""
    return _AllToAll.apply(x, group, 1, 2)


def all_to_all_sequence(x: Tensor, group: ProcessGroup) -> Tensor:
    """The inverse of :func:`all_to_all_heads`: head shards back to sequence shards with all heads."""
    return _AllToAll.apply(x, group, 2, 1)
