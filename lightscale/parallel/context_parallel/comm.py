"""The collectives of context parallelism.

- :func:`send_to_next`: every rank sends a tensor to the next rank of the group and receives the previous rank's
  (point-to-point, ``batch_isend_irecv``), asynchronously: :class:`Pending` waits for it, so the caller computes on
  the current block meanwhile. The ring's forward and backward (:mod:`.attention`) are written with it.
- :func:`all_gather_along` / :func:`reduce_scatter_along`: the group's tensors concatenated in rank order along a
  dimension, and its transpose (each rank gets the sum of every rank's block for its own); allgather mode's
  forward and backward.
- :func:`all_to_all_heads`: sequence shards to head shards (``(B, H, S/cp, D)`` -> ``(B, H/cp, S, D)``, the
  sequence in rank order) and :func:`all_to_all_sequence` back; autograd functions, each the other's backward.

Written here rather than taken from ``torch.distributed.nn.functional`` because that module's all-gather backward
emulates reduce-scatter on gloo with ``cp`` scatters, and its functions are deprecated.

Example:
    >>> pending = Pending()
    >>> kv_next = send_to_next(kv, group, pending)  # in flight
    >>> ...  # compute with kv
    >>> pending.wait()  # kv_next is now the previous rank's kv
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightscale.runtime.collectives import all_gather_single, reduce_scatter_single


class Pending:
    """Point-to-point requests started by :func:`send_to_next` and not yet waited for."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()


def send_to_next(x: Tensor, group: ProcessGroup, pending: Pending, *, tag: int = 0) -> Tensor:
    """Send ``x`` to the next rank of the group and receive the previous rank's into the tensor returned, valid
    after ``pending.wait()`` (one ``batch_isend_irecv``; the caller computes meanwhile). ``tag`` tells apart two
    kinds of message in flight between the same ranks at once."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % size, tag=tag),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % size, tag=tag),
    ]
    pending.works.extend(dist.batch_isend_irecv(ops))
    return received


def all_gather_along(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    """Every rank's ``x`` concatenated in rank order along ``dim`` (no autograd)."""
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((size * moved.shape[0], *moved.shape[1:]))
    all_gather_single(out, moved, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
    """This rank's block along ``dim`` of the sum of every rank's ``x`` (no autograd): the transpose of
    :func:`all_gather_along`."""
    size = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
    reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


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
