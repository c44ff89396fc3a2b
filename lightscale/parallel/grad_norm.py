"""Global gradient-norm clipping for parameters sharded over data, tensor and pipeline parallel ranks.

The norm clipped is that of the *whole* model's gradient, as on one device:
    * a DTensor gradient's norm is reduced over the mesh axes it is sharded on (``full_tensor`` of the partial
      norm), and counted once over axes it is replicated on;
    * gradients are grouped by (mesh, placements) because torch stacks per-tensor norms per group;
    * pipeline stages hold disjoint parameters: squared norms are summed over the pipeline group.

Example:
    >>> total = clip_grad_norm_(model.parameters(), 1.0, pp_group=mesh["pp"].get_group())
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def total_grad_norm(parameters: Iterable[Tensor], *, pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of all gradients of ``parameters`` across every parallel dimension (identical on all ranks)."""
    groups: dict[object, list[Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    squares = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares.to(norm.device) + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None
) -> Tensor:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; return the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, pp_group=pp_group)
    scale = min(1.0, max_norm / (total.item() + 1e-6))  # as torch.nn.utils.clip_grad_norm_
    if scale < 1.0:
        for param in params:
            param.grad.mul_(scale)
    return total
