"""Per-rank bytes of model state: parameters, gradients and optimizer state, counting only local shards.

Sharded strategies keep a slice of each tensor per rank: a DTensor's local tensor (FSDP2, tensor parallel) or an
engine's own partition (ZeRO-3). Counting those, not the logical shapes, is what says whether a model fits. Which
tensors a rank holds is the strategy's answer (lightscale/strategies/shards.py): its parameter tensors, the gradients
and state tensors its optimizer keeps.

Example:
    >>> model_state_bytes(model, trainer.optimizers, strategy=trainer.strategy).total
    1968128
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightscale.strategies.shards import TensorShards, shards_of


@dataclass(frozen=True)
class ModelStateBytes:
    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def model_state_bytes(
    module: nn.Module, optimizers: Iterable[Any] = (), *, strategy: object = None, device_type: str | None = None
) -> ModelStateBytes:
    """Bytes this rank holds for ``module``'s parameters and gradients and the optimizers' state, as ``strategy``
    (the trainer's; default: tensors torch describes, DTensor or whole) says it holds them.

    Each byte of storage counts once, in the first category that claims it (views of one flat buffer, tied
    weights). Gradients an optimizer keeps itself (ZeRO's partitions) count as gradients, its masters as optimizer
    state. ``device_type`` (``"cpu"``, ``"cuda"``) counts only tensors there: what offloading keeps in host memory.
    """
    rules = shards_of(strategy)
    optimizers = list(optimizers)
    ledger = _Ledger(rules, device_type)
    params = ledger.claim(t for p in module.parameters() for t in rules.parameter_tensors(p))
    grads = ledger.claim(
        [p.grad for p in module.parameters() if p.grad is not None]
        + [t for opt in optimizers for t in rules.optimizer_gradient_tensors(opt)]
    )
    states = ledger.claim(t for opt in optimizers for t in rules.optimizer_state_tensors(opt))
    return ModelStateBytes(params, grads, states)


class _Ledger:
    """Counts each byte of storage once, however many tensors view it."""

    def __init__(self, rules: TensorShards, device_type: str | None = None) -> None:
        self._spans: list[tuple[int, int]] = []  # claimed [start, end) address ranges, disjoint and sorted
        self._rules = rules
        self._device_type = device_type

    def claim(self, tensors: Iterable[Tensor]) -> int:
        """Bytes of ``tensors`` not claimed before (one sort per call: cheap enough to run every step)."""
        spans = []
        for tensor in tensors:
            local = self._rules.local_shard(tensor)  # a DTensor gradient or optimizer state: its local tensor
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
