"""What a strategy answers about the tensors it holds: the one place callbacks, the estimator, weight averaging and
checkpoint code ask instead of reading an engine's own attributes.

:class:`TensorShards` gives the answers for tensors torch describes itself: a DTensor (FSDP2, tensor parallel) knows
its global shape and its local tensor, a plain tensor is whole. Every lightscale strategy owns one as its
``tensor_shards`` (lightscale/strategies/base.py); an engine that keeps parameters its own way names a subclass next to
the engine (ZeRO: lightscale/strategies/deepspeed/shards.py, from lightscale/zero/). A strategy that is not lightscale's
(Lightning's own ``ddp``) gets these defaults through :func:`shards_of`.

Example:
    >>> rules = shards_of(trainer.strategy)
    >>> sum(rules.global_numel(p) for p in model.parameters())  # the same under fsdp2, zero3 or one process
    1968128
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parameter import UninitializedParameter


class TensorShards:
    """The answers a strategy gives about its tensors (stateless: one object serves every instance of a class);
    subclasses override where their engine differs."""

    def local_shard(self, tensor: Tensor) -> Tensor:
        """The one local-shard rule: the piece of ``tensor`` this rank holds, a writable alias (a DTensor's local
        tensor, else the tensor). An engine that keeps parameters its own way answers in its strategy (ZeRO)."""
        return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor.detach()

    def after_local_write(self, module: nn.Module) -> None:
        """After writing into local shards (an average swapped in): FSDP2 roots left unsharded by an eval forward
        would keep serving their stale gathered weights, so they reshard."""
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()

    def global_shape(self, tensor: Tensor) -> torch.Size:
        """The shape of the whole tensor, whichever rank holds which part (a DTensor's shape is its global one)."""
        return tensor.shape

    def global_numel(self, tensor: Tensor) -> int:
        """Elements of the whole tensor (0 for a lazy parameter whose shape is not known yet)."""
        if isinstance(tensor, UninitializedParameter) and not isinstance(tensor, DTensor):
            return 0  # a lazy module before its first forward (a DTensor parameter passes this isinstance too)
        return tensor.numel()  # a DTensor's numel is its global one; a meta tensor has its declared shape

    def is_flat_slice(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s local shard is this rank's slice of its flattened data, padded to the same size on
        every rank, rather than a DTensor shard or the whole tensor (a ZeRO-3 partition is)."""
        return False

    def parameter_tensors(self, param: Tensor) -> list[Tensor]:
        """Every tensor this rank stores for ``param``: its local shard (an engine may keep a gathered copy too)."""
        return [self.local_shard(param)]

    def optimizer_gradient_tensors(self, optimizer: Any) -> Iterator[Tensor]:
        """Gradients an optimizer keeps apart from ``param.grad`` (none for torch's; ZeRO's gradient partitions)."""
        return iter(())

    def optimizer_state_tensors(self, optimizer: Any) -> Iterator[Tensor]:
        """The state tensors of ``optimizer`` (a LightningOptimizer, a torch optimizer, or a wrapper of one that
        keeps it as ``.optimizer``), as the optimizer holds them (DTensor states stay DTensors)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the real one
        if isinstance(optimizer, torch.optim.Optimizer):
            for state in optimizer.state.values():
                yield from (value for value in state.values() if isinstance(value, Tensor))
            return
        inner = getattr(optimizer, "optimizer", None)  # an engine's optimizer wrapping the torch one
        if inner is not None:
            yield from self.optimizer_state_tensors(inner)


def shards_of(strategy: object) -> TensorShards:
    """The strategy's answers, or the defaults for a strategy that is not lightscale's (or none)."""
    answers = getattr(strategy, "tensor_shards", None)
    return answers if isinstance(answers, TensorShards) else TensorShards()
