"""The ZeRO strategy's answers about its tensors (lightscale/strategies/shards.py asks): a ZeRO-3 parameter is
DeepSpeed's, read through strategies/deepspeed/partition.py and optimizer_tensors.py; anything else gets the defaults.

Example:
    >>> shards_of(trainer.strategy).global_shape(param)  # under zero3: the full shape, not the empty data's
    torch.Size([512, 512])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightscale.strategies.deepspeed.optimizer_tensors import gradient_partitions, master_partitions
from lightscale.strategies.deepspeed.partition import (
    full_numel,
    is_partitioned,
    partition,
    regather_persistent,
    stored_tensors,
    whole_shape,
)
from lightscale.strategies.shards import TensorShards


class ZeroShards(TensorShards):
    """TensorShards for DeepSpeed's partitions (:class:`~lightscale.strategies.deepspeed.strategy.ZeroStrategy`'s
    ``tensor_shards``)."""

    @override
    def local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """A ZeRO-3 parameter's piece is its partition, persistent or not (strategies/deepspeed/partition.py)."""
        return partition(tensor) if is_partitioned(tensor) else super().local_shard(tensor)

    @override
    def after_local_write(self, module: nn.Module) -> None:
        regather_persistent(list(module.parameters()))

    @override
    def global_shape(self, tensor: torch.Tensor) -> torch.Size:
        return whole_shape(tensor)

    @override
    def global_numel(self, tensor: torch.Tensor) -> int:
        return full_numel(tensor) if is_partitioned(tensor) else super().global_numel(tensor)

    @override
    def is_flat_slice(self, tensor: torch.Tensor) -> bool:
        return is_partitioned(tensor)

    @override
    def parameter_tensors(self, param: torch.Tensor) -> list[torch.Tensor]:
        """The partition, and the whole data while a ZeRO-3 parameter is gathered (persistent ones always are)."""
        return stored_tensors(param) if is_partitioned(param) else super().parameter_tensors(param)

    @override
    def optimizer_gradient_tensors(self, optimizer: Any) -> Iterator[torch.Tensor]:
        return gradient_partitions(optimizer)

    @override
    def optimizer_state_tensors(self, optimizer: Any) -> Iterator[torch.Tensor]:
        """The fp32 master partitions, then the wrapped torch optimizer's state."""
        yield from master_partitions(optimizer)
        yield from super().optimizer_state_tensors(optimizer)
