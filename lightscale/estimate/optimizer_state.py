"""What an optimizer keeps per parameter, by class: elementwise states per element, or Adafactor's factored ones.

An elementwise optimizer keeps whole-parameter-sized tensors: Adam/AdamW two (``exp_avg``, ``exp_avg_sq``), SGD with
momentum and Muon one (``momentum_buffer``); they shard like the parameter (lightscale/estimate/model_states.py).
torch's Adafactor keeps, per parameter of two or more dimensions, a row factor of ``shape[:-1]`` elements
(``row_var``) and a column factor of ``shape[:-2] + shape[-1:]`` (``col_var``); per vector a full ``variance``; and a
float32 ``step`` each (torch/optim/_adafactor.py). Under the DTensor names ShardedAdafactor holds them placed like the
parameter (lightscale/optim/adafactor.py): FSDP2 splits dimension 0 into ``torch.chunk`` pieces (the first ranks get
the rounded-up count), so a matrix's row factor is split and its column factor, whose dimension 0 was summed away, is
whole on every rank.

Example:
    >>> adafactor_state_bytes([torch.Size((15, 8)), torch.Size((15,))], dp_shard=2, dtype_bytes=4)
    104
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Whole-parameter-sized tensors an elementwise optimizer keeps (SGD: with momentum).
STATES_PER_ELEMENT: dict[type[torch.optim.Optimizer], int] = {
    torch.optim.Adam: 2,
    torch.optim.AdamW: 2,
    torch.optim.SGD: 1,
    torch.optim.Muon: 1,
}
STEP_BYTES = 4  # torch keeps Adafactor's step as a float32 scalar tensor per parameter


def states_per_element(optimizer: type[torch.optim.Optimizer], default: int) -> int:
    """How many parameter-sized tensors ``optimizer`` keeps (``default`` for a class not listed)."""
    for known, count in STATES_PER_ELEMENT.items():
        if issubclass(optimizer, known):
            return count
    return default


def is_factored(optimizer: type[torch.optim.Optimizer] | None) -> bool:
    return optimizer is not None and issubclass(optimizer, torch.optim.Adafactor)


def adafactor_state_bytes(shapes: Sequence[torch.Size], *, dp_shard: int, dtype_bytes: int) -> int:
    """torch.optim.Adafactor's state on the most loaded rank for parameters of ``shapes``, dimension 0 split over
    ``dp_shard`` ranks (1: whole); the factors in the gradients' dtype (``dtype_bytes``), the step in float32."""
    elements = 0
    for shape in shapes:
        rows = math.ceil(shape[0] / dp_shard) if len(shape) else 1  # dimension 0 on the most loaded rank
        if len(shape) >= 2:
            elements += rows * math.prod(shape[1:-1])  # row_var: shape[:-1]
            elements += rows * math.prod(shape[1:-2]) * shape[-1] if len(shape) >= 3 else shape[-1]  # col_var
        else:
            elements += rows  # variance
    return elements * dtype_bytes + STEP_BYTES * len(shapes)
