"""torch's optimizer contract for ``step(closure)``: the closure re-evaluates the loss with gradients enabled.

Example:
    >>> loss = closure_loss(closure)  # None without a closure
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """The closure's loss, computed with gradients on (``step`` itself runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
