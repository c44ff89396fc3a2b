"""torch internals lightscale wraps on one object, where torch has no argument for it.

Example:
    >>> wrap_stage_method(stage, "_prepare_forward_infra", not_counted)
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightscale.patches.table import Patch

PATCHES = [
    Patch(
        "PipelineStage._prepare_forward_infra",
        "instance",
        "the stage's shape inference runs a forward the MoE load balancer would count as training tokens; wrapped "
        "on each stage so that forward is not counted",
        "a way to give PipelineStage its input/output metadata without a forward, or a flag telling modules so",
        signature=(
            "torch.distributed.pipelining.stage:PipelineStage._prepare_forward_infra",
            ("self", "num_microbatches", "args", "kwargs", "has_backward"),
        ),
    ),
    Patch(
        "optimizer.step._wrapped_by_lr_sched, optimizer._opt_called (as LRScheduler.__init__ sets them)",
        "instance",
        "under ZeRO offload the optimizer that steps is built after the user's scheduler; the scheduler is pointed "
        "at it and its step tracked as torch's scheduler constructor does, or torch warns of a wrong call order",
        "a public LRScheduler method to rebind its optimizer",
        attributes=("torch.optim.lr_scheduler:LRScheduler", ("_opt_called", "_wrapped_by_lr_sched")),
    ),
]


def wrap_stage_method(stage: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Shadow ``stage.<name>`` on this stage only by ``wrap(bound method)``."""
    setattr(stage, name, wrap(getattr(stage, name)))


def track_optimizer_steps(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way ``LRScheduler.__init__`` does, so its first ``step()`` does not warn."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return  # the optimizer the scheduler was built on: tracked already
    step = optimizer.step.__func__  # type: ignore[attr-defined]
    owner = weakref.ref(optimizer)  # as torch does: no reference cycle through the instance attribute

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]
