"""The optimizer a strategy steps in place of the user's, with every LR scheduler pointed at it.

The user's ``configure_optimizers`` builds the optimizer and its schedulers before the strategy sees them; a strategy
that must step another object (ShardedAdafactor for torch's Adafactor on DTensor shards; DeepSpeed's CPU Adam under
offload) swaps it in the strategy's list and rebinds the schedulers, so ``self.optimizers()`` and the schedules
follow the one that really steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from lightscale.optim.adafactor import sharded_adafactor_from
from lightscale.optim.combined import CombinedOptimizer
from lightscale.optim.flat_muon import FlatGroup, FlatMuon, flat_muon_from
from lightscale.optim.muon import sharded_muon_from
from lightscale.optim.rule import ParameterView
from lightscale.patches.torch_internals import track_optimizer_steps


def rebind_scheduler(scheduler: LRScheduler, optimizer: torch.optim.Optimizer) -> None:
    """Point a scheduler built on the user's optimizer at the one that really steps (the host optimizer under
    offload, a sharded stepper), and track that optimizer's steps as torch's scheduler does at construction.

    The user's ``configure_optimizers`` builds both before the strategy swaps the optimizer; without the tracking,
    torch's first ``scheduler.step()`` warns that ``optimizer.step()`` "has been overridden after learning rate
    scheduler initialization", although the order is right.

    Example:
        >>> rebind_scheduler(scheduler, cpu_adam_from(optimizer))
    """
    scheduler.optimizer = optimizer
    track_optimizer_steps(optimizer)  # torch's own marking: lightscale/patches/torch_internals.py


def exact_optimizer(optimizer: torch.optim.Optimizer, view: ParameterView) -> torch.optim.Optimizer:
    """The optimizer that steps ``optimizer``'s math under ``view``: itself, or on DTensor shards ShardedAdafactor for
    torch's Adafactor and ShardedMuon for torch's Muon (also as parts of a CombinedOptimizer, replaced in place); on
    ZeRO's flat partitions FlatMuon for torch's Muon."""
    if isinstance(optimizer, CombinedOptimizer):
        optimizer.optimizers = [exact_optimizer(part, view) for part in optimizer.optimizers]
        optimizer.sync_groups()
        return optimizer
    if view == "dtensor" and type(optimizer) is torch.optim.Adafactor:
        return sharded_adafactor_from(optimizer)
    if view == "dtensor" and type(optimizer) is torch.optim.Muon:
        return sharded_muon_from(optimizer)
    if view == "flat_mapped" and type(optimizer) is torch.optim.Muon:
        return flat_muon_from(optimizer)
    return optimizer


def attach_flat(optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> None:
    """Tell ``optimizer`` where ZeRO's flat partitions lie (``groups``, from deepspeed/partition.py): FlatMuon
    where its matrices are; a CombinedOptimizer which part keeps each partition's state, and each FlatMuon part the
    partitions of its own groups."""
    if isinstance(optimizer, FlatMuon):
        optimizer.attach(groups)
    if not isinstance(optimizer, CombinedOptimizer):
        return
    for flat in groups:
        optimizer.own(flat.partition, flat.param_group)
    for part in optimizer.optimizers:
        ids = {id(group) for group in part.param_groups}
        attach_flat(part, [flat for flat in groups if id(optimizer.param_groups[flat.param_group]) in ids])


def install_exact_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any], view: ParameterView
) -> list[torch.optim.Optimizer]:
    """``optimizers`` with each replaced by :func:`exact_optimizer`; ``schedulers`` (Lightning's configs or torch
    schedulers) of a replaced one are rebound to its replacement."""
    installed = []
    for optimizer in optimizers:
        exact = exact_optimizer(optimizer, view)
        for config in schedulers:
            scheduler = getattr(config, "scheduler", config)
            if exact is not optimizer and getattr(scheduler, "optimizer", None) is optimizer:
                rebind_scheduler(scheduler, exact)
        installed.append(exact)
    return installed
