"""0-dimensional parameters beside FSDP2's shards: kept whole on every rank, their gradients all-reduced.

``fully_shard`` cuts each parameter along dimension 0 and refuses 0-dimensional ones ("doesn't support scalar
parameters"). A learnable temperature (``nn.Parameter(torch.tensor(1.0))``, OpenCLIP's ``logit_scale``) is common in
models users cannot edit, and sharding one element buys nothing. So :func:`apply_fsdp` leaves them out of FSDP
(``ignored_params``) and :class:`ScalarGradients` does for them what DDP does: after each backward that syncs
gradients, it averages their gradients over the data-parallel mesh, the mean FSDP's reduce-scatter takes of the
sharded ones. All ranks start from the same value (the strategies broadcast rank 0's weights), all-reduce gives every
rank the same bits, and the optimizer steps the same numbers on each, so the replicas never drift. The user's module
keeps its own tensor, shape ``[]``: forward, ``state_dict`` and every checkpoint see the shape the user wrote, and a
checkpoint writer stores the whole tensor once (DCP deduplicates replicated plain tensors).

Example:
    >>> scalars = scalar_parameters(model)  # {model.logit_scale}
    >>> fully_shard(model, mesh=mesh, ignored_params=scalars)
    >>> ScalarGradients(model, mesh)  # averages model.logit_scale.grad over mesh after each backward
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

_REDUCERS: weakref.WeakKeyDictionary[nn.Module, ScalarGradients] = weakref.WeakKeyDictionary()


def scalar_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The 0-dimensional (not DTensor) parameters of ``module``: those FSDP2 cannot shard."""
    return {p for p in module.parameters() if p.ndim == 0 and not isinstance(p, DTensor)}


class ScalarGradients:
    """Average the gradients of ``root``'s 0-dimensional parameters over ``mesh`` (every dimension) after backward.

    The gradient hooks are (re)attached before each forward of ``root``, to whichever tensors its 0-dimensional
    parameters are then: materializing a meta-device model replaces plain parameters with new tensors.
    :func:`set_scalar_sync` turns the all-reduce off inside a gradient-accumulation micro-step, as FSDP's
    ``set_requires_gradient_sync`` does for the shards; the step that syncs then averages the accumulated sum.
    """

    def __init__(self, root: nn.Module, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.enabled = True
        self._hooked: weakref.WeakSet[nn.Parameter] = weakref.WeakSet()
        root.register_forward_pre_hook(self._attach)
        self._attach(root, ())
        _REDUCERS[root] = self

    def _attach(self, module: nn.Module, args: Any) -> None:
        for param in scalar_parameters(module):
            if param.requires_grad and param not in self._hooked:
                param.register_post_accumulate_grad_hook(self._reduce)
                self._hooked.add(param)

    def _reduce(self, param: torch.Tensor) -> None:
        if not self.enabled or param.grad is None:
            return
        wire = param.grad.to(self.mesh.device_type)  # an offloaded (host) scalar crosses an accelerator's group there
        for dim in range(self.mesh.ndim):  # sum over each axis in turn = sum over the whole mesh (HSDP: 2-D)
            dist.all_reduce(wire, group=self.mesh.get_group(dim))
        wire.div_(self.mesh.size())
        if wire is not param.grad:
            param.grad.copy_(wire)


def set_scalar_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the gradient all-reduce of every :class:`ScalarGradients` inside ``model`` on or off."""
    for module in model.modules():
        reducer = _REDUCERS.get(module)
        if reducer is not None:
            reducer.enabled = enabled
