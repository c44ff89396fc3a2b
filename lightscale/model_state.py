"""Per-rank bytes of model state: parameters, gradients and optimizer state, counting only local shards.

Sharded strategies keep a slice of each tensor per rank: a DTensor's local tensor (FSDP2, tensor parallel)
or a DeepSpeed ZeRO-3 partition (``param.ds_tensor``). Counting those, not the logical shapes, is what says
whether a model fits.

Example:
    >>> model_state_bytes(model, trainer.optimizers).total
    1968128
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def local_tensor(tensor: Tensor) -> Tensor:
    """The part of ``tensor`` this rank stores."""
    partition = getattr(tensor, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps the shard beside an empty param
    if partition is not None:
        return partition
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def model_state_bytes(module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> ModelStateBytes:
    """Bytes this rank holds for ``module``'s parameters and gradients and the optimizers' state."""
    params = list(module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [t for opt in optimizers for t in _optimizer_tensors(opt)]
    return ModelStateBytes(_unique_bytes(params), _unique_bytes(grads), _unique_bytes(states))


def _optimizer_tensors(optimizer: Optimizer) -> Iterator[Tensor]:
    inner = getattr(optimizer, "optimizer", None)  # wrappers (LightningOptimizer, engines) hold the real one
    if isinstance(inner, Optimizer):
        yield from _optimizer_tensors(inner)
        return
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, Tensor))


def _unique_bytes(tensors: Iterable[Tensor]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in tensors:
        local = local_tensor(tensor)
        key = (local.data_ptr(), local.numel())
        if local.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total
