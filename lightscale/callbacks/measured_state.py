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
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightscale.zero.partition import is_partitioned, partition


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
    if is_partitioned(tensor):  # DeepSpeed ZeRO-3 keeps the shard beside an empty (or, persistent, whole) param
        return partition(tensor)
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[Any] = (), *, device_type: str | None = None
) -> ModelStateBytes:
    """Bytes this rank holds for ``module``'s parameters and gradients and the optimizers' state.

    Each byte of storage counts once, in the first category that claims it (views of one flat buffer, tied
    weights). DeepSpeed's ZeRO optimizers are read too: their gradient partitions count as gradients, their
    fp32 master partitions as optimizer state. ``device_type`` (``"cpu"``, ``"cuda"``) counts only tensors there:
    what offloading keeps in host memory.
    """
    optimizers = list(optimizers)
    ledger = _Ledger(device_type)
    params = ledger.claim(_parameter_tensors(module))
    grads = ledger.claim(
        [p.grad for p in module.parameters() if p.grad is not None]
        + [t for opt in optimizers for t in _zero_gradient_partitions(_unwrap(opt))]
    )
    states = ledger.claim(t for opt in optimizers for t in _optimizer_tensors(_unwrap(opt)))
    return ModelStateBytes(params, grads, states)


def _parameter_tensors(module: nn.Module) -> Iterator[Tensor]:
    for param in module.parameters():
        yield local_tensor(param)
        if is_partitioned(param) and param.data.numel() > 0:
            yield param.data  # a ZeRO-3 parameter that is gathered right now (or persistent) holds both


def _unwrap(optimizer: Any) -> Any:
    # LightningOptimizer wraps the real one; DeepSpeed's ZeRO optimizers wrap the torch optimizer and are not
    # torch Optimizers themselves.
    return getattr(optimizer, "_optimizer", optimizer)


def _zero_gradient_partitions(optimizer: Any) -> Iterator[Tensor]:
    for name in ("averaged_gradients", "grad_partitions_flat_buffer", "offload_gradient_dict"):
        yield from _tensors_in(getattr(optimizer, name, None))


def _optimizer_tensors(optimizer: Any) -> Iterator[Tensor]:
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO fp32 master weights
        yield from _tensors_in(getattr(optimizer, name, None))
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and not isinstance(optimizer, Optimizer):
        yield from _optimizer_tensors(inner)
        return
    if isinstance(optimizer, Optimizer):
        for state in optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, Tensor))


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


class _Ledger:
    """Counts each byte of storage once, however many tensors view it."""

    def __init__(self, device_type: str | None = None) -> None:
        self._spans: list[tuple[int, int]] = []  # claimed [start, end) address ranges, disjoint and sorted
        self._device_type = device_type

    def claim(self, tensors: Iterable[Tensor]) -> int:
        """Bytes of ``tensors`` not claimed before (one sort per call: cheap enough to run every step)."""
        spans = []
        for tensor in tensors:
            local = local_tensor(tensor)
            if local.numel() == 0 or local.device.type == "meta":
                continue
            if self._device_type is not None and local.device.type != self._device_type:
                continue
            start = local.data_ptr()
            spans.append((start, start + local.numel() * local.element_size()))
        new = _merged(spans)
        fresh = _length(new) - _overlap(new, self._spans)
        self._spans = _merged(self._spans + new)
        return fresh


def _length(spans: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in spans)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Bytes two sorted, disjoint span lists share (one linear sweep)."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
