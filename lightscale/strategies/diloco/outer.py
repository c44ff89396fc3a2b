"""The outer loop as DiLoCo's strategy drives it: the OuterSync it builds (or torchft's, fault-tolerant), a
synchronous step's gradient average inside the closure, and validation on the global model.

Example:
    >>> kept = globals_in(outer)  # validation measures the global model ...
    >>> locals_back(outer, kept)  # ... then each worker's own parameters come back
"""

from __future__ import annotations

from typing import Any

import torch

from lightscale.parallel.diloco import OuterSync


def averaging_gradients(closure: Any, outer: OuterSync) -> Any:
    """``closure`` followed by the average of the gradients over the workers (a synchronous step), before clipping."""

    def closure_then_average() -> Any:
        result = closure()
        outer.average_gradients()
        return result

    return closure_then_average


def globals_in(outer: OuterSync) -> list[torch.Tensor]:
    """Copy the global model into the live parameters; returns each worker's own ones, for ``locals_back``."""
    kept = [outer.local(i).clone() for i in range(len(outer.params))]
    with torch.no_grad():
        for i, (_, tensor) in enumerate(outer.named_globals()):
            outer.local(i).copy_(tensor)
    return kept


def locals_back(outer: OuterSync, kept: list[torch.Tensor]) -> None:
    """The worker's own parameters, kept by ``globals_in``, back in the live ones."""
    with torch.no_grad():
        for i, tensor in enumerate(kept):
            outer.local(i).copy_(tensor)
