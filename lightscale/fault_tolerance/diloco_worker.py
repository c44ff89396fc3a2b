"""What ``DiLoCoStrategy(fault_tolerant=...)`` adds to the strategy: this launch is one worker that meets the others
through torchft, reads its own part of the data and joins its first quorum before reading it.

The worker's outer sync is :class:`~lightscale.fault_tolerance.diloco.FaultTolerantOuterSync`; at the first quorum a
restarted worker heals from a live peer and reads on from the peers' step; every round is logged on rank 0. The
settings are checked here, before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.diloco import FaultTolerantOuterSync, RoundRecord
from lightscale.fault_tolerance.replica import move_sampler
from lightscale.fault_tolerance.replica import replica_data_shard as worker_data_shard  # noqa: F401 - one rule
from lightscale.fault_tolerance.settings import FaultTolerance, fault_tolerance_of
from lightscale.parallel.data_parallel import broadcast_module_state, broadcast_tensors


def worker_fault_tolerance(
    fault_tolerant: FaultTolerance | bool, workers: int | None, fragments: int, overlap_steps: int, compression: str
) -> FaultTolerance | None:
    """The settings of ``DiLoCoStrategy(fault_tolerant=)`` (``None`` when off): :func:`fault_tolerance_of`'s
    refusals, then those of the other settings that cannot run fault-tolerant."""
    ft = fault_tolerance_of(fault_tolerant, "fault_tolerant DiLoCo")
    if ft is None:
        return None
    if workers not in (None, 1):
        raise ConfigurationError(
            f"workers={workers} cannot be set with fault_tolerant: each fault-tolerant worker is a launch of its own "
            f"(its devices x nodes ranks), and the workers meet at the lighthouse. Leave workers unset."
        )
    if fragments != 1 or overlap_steps != 0 or compression != "none":
        raise ConfigurationError(
            f"fault_tolerant DiLoCo averages one fp32 payload per round at once; it needs fragments=1, "
            f"overlap_steps=0 and compression='none', not fragments={fragments}, overlap_steps={overlap_steps}, "
            f"compression={compression!r}."
        )
    return ft


def fault_tolerant_outer_sync(
    ft: FaultTolerance,
    module: nn.Module,
    *,
    sync_every: int,
    mode: str,
    outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
    world_size: int,
) -> FaultTolerantOuterSync:
    """The outer sync of this worker, through torchft's lighthouse; every round logged on rank 0."""
    return FaultTolerantOuterSync(
        module.named_parameters(),
        sync_every=sync_every,
        settings=ft,
        mode=mode,
        outer_optimizer=outer_optimizer,
        on_round=_log_round,
        group=dist.group.WORLD if world_size > 1 else None,
    )


def join_first_quorum(
    ft: FaultTolerantOuterSync, loader: object, trainer: Trainer, *, model: nn.Module, replicas: object | None
) -> None:
    """The worker's first quorum, before its data is read: a restarted worker heals from a live peer and its sampler
    (one with ``resume_from(epoch, batches)``, as lightscale's) reads on from the peers' step within the epoch.
    ``replicas``: the process group of the worker's replicas (an inner ``bucketed_ddp`` on several ranks), or None."""
    heals = ft.heals
    ft.before_inner_step()
    if replicas is not None:
        # torchft heals each rank from the same rank of some peer; at the start the peers still differ, so the
        # worker's replicas take its rank 0's (later, every up-to-date peer holds the same state).
        broadcast_module_state(model, process_group=replicas)
        broadcast_tensors([tensor for _, tensor in ft.sync.named_globals()], process_group=replicas)
    if ft.heals > heals and not move_sampler(
        loader, trainer.current_epoch, ft.sync.step * trainer.accumulate_grad_batches
    ):
        sampler = getattr(loader, "sampler", None)
        rank_zero_warn(
            f"This worker healed to step {ft.sync.step} but its sampler ({type(sampler).__name__}) "
            f"has no resume_from(epoch, batches): it reads its data from where it started."
        )


def _log_round(record: RoundRecord, payload: torch.Tensor, mean: torch.Tensor | None) -> None:
    outcome = "committed" if record.committed else "dropped (a worker of the round failed)"
    rank_zero_info(f"diloco-ft: round {record.round} at step {record.step}: {outcome}, {record.participants} worker(s)")
