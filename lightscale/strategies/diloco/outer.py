"""The outer loop as DiLoCo's strategy drives it: the OuterSync it builds (``outer_sync_for``; torchft's when
fault-tolerant), a synchronous step's gradient average inside the closure, and validation on the global model.

Example:
    >>> kept = globals_in(outer)  # validation measures the global model ...
    >>> locals_back(outer, kept)  # ... then each worker's own parameters come back
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightscale.fault_tolerance.diloco import FaultTolerantOuterSync
from lightscale.fault_tolerance.diloco_worker import fault_tolerant_outer_sync
from lightscale.parallel.diloco import OuterSync
from lightscale.parallel.mesh import axis

if TYPE_CHECKING:
    from lightscale.strategies.diloco.strategy import DiLoCoStrategy


def outer_sync_for(strategy: DiLoCoStrategy, module: nn.Module) -> tuple[OuterSync, FaultTolerantOuterSync | None]:
    """The OuterSync over the ``dp_replicate`` group that ``strategy``'s settings ask for, or torchft's (with the
    :class:`~lightscale.parallel.diloco.FaultTolerantOuterSync` that holds it) when fault-tolerant."""
    outer_optimizer = strategy._outer_optimizer if strategy.mode == "diloco" else None
    schedule = strategy.schedule
    if outer_optimizer is not None:
        chosen = "the default for this H" if strategy.outer_step_defaulted else "as given"
        rank_zero_info(
            f"lightscale: DiLoCo outer step every {schedule.sync_every} steps: SGD lr {strategy.outer_lr}, "
            f"Nesterov momentum {strategy.outer_momentum} ({chosen}; docs/strategies/diloco.md)."
        )
    if strategy.ft_settings is not None:
        ft = fault_tolerant_outer_sync(
            strategy.ft_settings, module, sync_every=schedule.sync_every, mode=strategy.mode,
            outer_optimizer=outer_optimizer, world_size=strategy.world_size,
        )  # fmt: skip
        return ft.sync, ft
    outer = OuterSync(
        module.named_parameters(), sync_every=schedule.sync_every,
        group=axis(strategy.device_mesh, "dp_replicate").get_group(), mode=strategy.mode,
        outer_optimizer=outer_optimizer, fragments=schedule.fragments, overlap_steps=schedule.overlap_steps,
        compression=strategy.compression, broadcast_start=False, synchronous_steps=strategy.synchronous_steps,
    )  # fmt: skip
    return outer, None


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
