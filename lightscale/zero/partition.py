"""What a ZeRO-3 parameter is made of, in DeepSpeed's own attributes: its partition, its full shape, its persistence.

DeepSpeed's stage 3 replaces each parameter's data by an empty tensor and keeps this rank's slice of the flat
parameter in ``param.ds_tensor`` (padded to ``ceil(numel / ranks)``); the full shape is ``ds_shape``. Parameters
under ``stage3_param_persistence_threshold`` (default 100k elements) are *persistent*: gathered whole once and kept,
but their partition is still what the optimizer updates (DeepSpeed re-gathers them after each step). So the rank's
own piece of every ZeRO-3 parameter, persistent or not, is its partition: one rule, which the strategy answers with
(lightscale/strategies/zero.py ``local_shard``).

Example:
    >>> partition(param) is param.ds_tensor
    True
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_partitioned(tensor: Tensor) -> bool:
    """A ZeRO-3 parameter (persistent or not)."""
    return hasattr(tensor, "ds_tensor")


def partition(tensor: Tensor) -> Tensor:
    """This rank's slice of a ZeRO-3 parameter's flat data: a writable alias the optimizer updates."""
    return tensor.ds_tensor.detach()  # type: ignore[attr-defined]


def full_shape(tensor: Tensor) -> torch.Size:
    return torch.Size(tensor.ds_shape)  # type: ignore[attr-defined]


def full_numel(tensor: Tensor) -> int:
    return int(tensor.ds_numel)  # type: ignore[attr-defined]


def stored_tensors(tensor: Tensor) -> list[Tensor]:
    """Every tensor this rank stores for a ZeRO-3 parameter: its partition, and the whole data while it is gathered
    (persistent parameters always are)."""
    return [partition(tensor), *([tensor.data] if tensor.data.numel() > 0 else [])]


def whole_shape(tensor: Tensor) -> torch.Size:
    """The full shape of a ZeRO-3 parameter, the shape of any other tensor."""
    return full_shape(tensor) if is_partitioned(tensor) else tensor.shape


def whole_numel(tensor: Tensor) -> int:
    """The full size of a ZeRO-3 parameter, the size of any other tensor."""
    return full_numel(tensor) if is_partitioned(tensor) else tensor.numel()


def master_device(tensor: Tensor) -> torch.device:
    """Where the optimizer's copy of ``tensor`` lives: its partition's device under ZeRO-3 (offloaded: the host)."""
    return partition(tensor).device if is_partitioned(tensor) else tensor.device


@torch.no_grad()
def regather_persistent(params: list[Tensor]) -> None:
    """After writing into partitions: gather the persistent parameters again, as DeepSpeed does after a step (they
    are read whole in forward, without a gather; the others are gathered at their next use)."""
    persistent = [p for p in params if is_partitioned(p) and getattr(p, "ds_persist", False)]
    if persistent:  # release the stale whole copies (partitions untouched), then gather: DeepSpeed's own pair
        persistent[0].partition(param_list=persistent, has_been_updated=False)  # type: ignore[attr-defined]
        persistent[0].all_gather(param_list=persistent)  # type: ignore[attr-defined]
