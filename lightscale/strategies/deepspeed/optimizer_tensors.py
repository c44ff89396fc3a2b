"""The tensors a DeepSpeed ZeRO optimizer keeps beside the torch optimizer it wraps, in its own attributes: gradient
partitions and fp32 master partitions (what the ZeRO strategy answers when asked for an optimizer's tensors).

ZeRO-1/2 (``DeepSpeedZeroOptimizer``) keep the reduced gradients in ``averaged_gradients`` (or, offloaded, in
``offload_gradient_dict``) and the fp32 masters in ``single_partition_of_fp32_groups``; ZeRO-3
(``DeepSpeedZeroOptimizer_Stage3``) in ``grad_partitions_flat_buffer`` and ``fp32_partitioned_groups_flat``. An
attribute a version does not have is skipped: the counts are a measurement, never a reason to stop.

Example:
    >>> sum(t.numel() for t in master_partitions(engine.optimizer))  # this rank's fp32 masters
    492032
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor

GRADIENTS = ("averaged_gradients", "grad_partitions_flat_buffer", "offload_gradient_dict")
MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def unwrap(optimizer: Any) -> Any:
    """The optimizer a LightningOptimizer wraps (DeepSpeed's ZeRO optimizers are not torch Optimizers)."""
    return getattr(optimizer, "_optimizer", optimizer)


def gradient_partitions(optimizer: Any) -> Iterator[Tensor]:
    """This rank's gradient partitions held by a ZeRO optimizer (nothing for any other optimizer)."""
    optimizer = unwrap(optimizer)
    for name in GRADIENTS:
        yield from _tensors_in(getattr(optimizer, name, None))


def master_partitions(optimizer: Any) -> Iterator[Tensor]:
    """This rank's fp32 master partitions held by a ZeRO optimizer (nothing for any other optimizer)."""
    optimizer = unwrap(optimizer)
    for name in MASTERS:
        yield from _tensors_in(getattr(optimizer, name, None))


def _tensors_in(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
    elif hasattr(value, "flat_partition"):  # DeepSpeed's GradPartitionBufferGroup: views of one flat buffer
        yield value.flat_partition
