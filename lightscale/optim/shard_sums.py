"""Sums over the ranks that split a tensor's dimensions: what a shape-dependent optimizer needs to step DTensor shards.

A DTensor's ``placements`` say which mesh dimension splits which tensor dimension (``Shard(d)``, FSDP-over-TP's
strided shard: anything with a ``dim``); ``Replicate`` splits nothing. A statistic summed over tensor dimensions ``D``
on the local shard becomes the global one after an all-reduce over the mesh dimensions that split a dimension in ``D``.
:class:`ShardSums` collects such partial sums and reduces them in one flat all-reduce per process group, so an
optimizer's step costs a few all-reduces per parameter group, not one per tensor.

Example:
    >>> sums = ShardSums()
    >>> total = sums.add(local.square().sum().reshape(1), layout_of(param), dims=None)  # over every dimension
    >>> sums.reduce()  # total now holds the sum over the whole parameter
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate


@dataclass(frozen=True)
class ShardLayout:
    """How a tensor is split: its mesh and placements (none for a plain tensor) and its global shape."""

    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]
    shape: torch.Size

    def mesh_dims_splitting(self, dims: Iterable[int] | None) -> tuple[int, ...]:
        """The mesh dimensions that split any of ``dims`` (None: any dimension) of the tensor."""
        wanted = None if dims is None else {d % len(self.shape) for d in dims}
        return tuple(
            mesh_dim
            for mesh_dim, placement in enumerate(self.placements)
            if (split := split_dim(placement)) is not None and (wanted is None or split in wanted)
        )

    def placements_without(self, dim: int) -> tuple[Placement, ...]:
        """The placements of a statistic whose dimension ``dim`` was summed away (size 1: replicated there)."""
        dim %= len(self.shape)
        return tuple(Replicate() if split_dim(p) == dim else p for p in self.placements)


def split_dim(placement: Placement) -> int | None:
    """The tensor dimension ``placement`` splits (``Shard``, strided shards), or None (``Replicate``)."""
    return getattr(placement, "dim", None)


def layout_of(tensor: torch.Tensor) -> ShardLayout:
    if isinstance(tensor, DTensor):
        return ShardLayout(tensor.device_mesh, tuple(tensor.placements), tensor.shape)
    return ShardLayout(None, (), tensor.shape)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a writable alias for a DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``param``'s gradient, aligned with its shard of the parameter: a DTensor gradient placed
    otherwise (tensor parallelism leaves some replicated) is redistributed to the parameter's placements first."""
    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local(grad)


def like_layout(
    local_tensor: torch.Tensor, layout: ShardLayout, placements: tuple[Placement, ...], shape: torch.Size
) -> torch.Tensor:
    """``local_tensor`` as a DTensor of global ``shape`` on ``layout``'s mesh with ``placements`` (plain when the
    layout has no mesh). The shape is given: FSDP's shards may be uneven, which DTensor cannot infer."""
    if layout.mesh is None:
        return local_tensor
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_tensor, layout.mesh, placements, run_check=False, shape=shape, stride=stride)


class ShardSums:
    """Partial sums to complete across the ranks that split them, reduced together by :meth:`reduce`."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, ShardLayout, tuple[int, ...]]] = []

    def add(self, partial: torch.Tensor, layout: ShardLayout, *, dims: Iterable[int] | None) -> torch.Tensor:
        """Register ``partial`` (summed locally over tensor dimensions ``dims``; None: all) and return it: after
        :meth:`reduce` it holds the global sum (in place)."""
        mesh_dims = layout.mesh_dims_splitting(dims)
        if mesh_dims:
            self._items.append((partial, layout, mesh_dims))
        return partial

    def reduce(self) -> int:
        """One all-reduce per process group over every registered partial sum (fp32); returns how many ran."""
        by_group: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
        for partial, layout, mesh_dims in self._items:
            assert layout.mesh is not None
            for mesh_dim in mesh_dims:
                by_group.setdefault(layout.mesh.get_group(mesh_dim), []).append(partial)
        for group, partials in by_group.items():  # same order on every rank: the parameters' order
            flat = torch.cat([p.reshape(-1).float() for p in partials])
            dist.all_reduce(flat, group=group)
            for partial, piece in zip(partials, flat.split([p.numel() for p in partials]), strict=True):
                partial.copy_(piece.view_as(partial))
        self._items.clear()
        return len(by_group)
