"""What ZeRO partitions are made of, in DeepSpeed's own attributes: a ZeRO-3 parameter's partition, full shape and
persistence; where each parameter lies in the flat partitions the optimizer steps (:func:`flat_groups`).

DeepSpeed's stage 3 replaces each parameter's data by an empty tensor and keeps this rank's slice of the flat
parameter in ``param.ds_tensor`` (padded to ``ceil(numel / ranks)``); the full shape is ``ds_shape``. Parameters
under ``stage3_param_persistence_threshold`` (default 100k elements) are *persistent*: gathered whole once and kept,
but their partition is still what the optimizer updates (DeepSpeed re-gathers them after each step). So the rank's
own piece of every ZeRO-3 parameter, persistent or not, is its partition: one rule, which the strategy answers with
(lightscale/strategies/deepspeed/shards.py ``local_shard``).

Example:
    >>> partition(param) is param.ds_tensor
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightscale.errors import ConfigurationError
from lightscale.optim.flat_muon import FlatGroup, FlatSpan


def is_partitioned(tensor: Tensor) -> bool:
    """A ZeRO-3 parameter (persistent or not)."""
    return hasattr(tensor, "ds_tensor")


def partition(tensor: Tensor) -> Tensor:
    """This rank's slice of a ZeRO-3 parameter's flat data: a writable alias the optimizer updates."""
    return tensor.ds_tensor.detach()  # type: ignore[attr-defined]


def full_shape(tensor: Tensor) -> torch.Size:
    return torch.Size(tensor.ds_shape)  # type: ignore[attr-defined]


def set_full_shape(tensor: Tensor, shape: torch.Size) -> None:
    """Give a ZeRO-3 parameter of the same number of elements another full shape: what it is gathered to."""
    assert shape.numel() == full_numel(tensor), (shape, full_numel(tensor))
    tensor.ds_shape = shape  # type: ignore[attr-defined]


def full_numel(tensor: Tensor) -> int:
    return int(tensor.ds_numel)  # type: ignore[attr-defined]


def largest_parameter(module: torch.nn.Module) -> int:
    """The number of elements of the module's largest parameter, partitioned (ZeRO-3) or not."""
    return max((whole_shape(param).numel() for param in module.parameters()), default=1)


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


def own_piece(tensor: Tensor, whole: Tensor) -> Tensor:
    """This rank's piece of ``whole``, a value of ZeRO-3 parameter ``tensor``, laid out as its partition: elements
    [r p, (r + 1) p) of the flattened value, p = ``partition_numel`` (``ceil(numel / ranks)``), zero past the end.
    With fewer elements than ranks, or a size the ranks do not divide, the last ranks' pieces are partly or wholly
    padding (DeepSpeed's ``set_full_hp_param`` narrows past the end there instead)."""
    size = int(tensor.partition_numel())  # type: ignore[attr-defined]
    rank = dist.get_rank(group=tensor.ds_process_group)  # type: ignore[attr-defined]
    flat = whole.reshape(-1)
    piece = flat[min(rank * size, flat.numel()) :][:size]
    return torch.nn.functional.pad(piece, (0, size - piece.numel()))


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


# The fp32 partitions the inner optimizer steps, by ZeRO optimizer: ZeRO-3, ZeRO-1/2, and ZeRO-1 in bf16 (DeepSpeed's
# BF16_Optimizer).
_FP32_PARTITIONS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def fp32_partitions(zero: Any) -> list[Tensor]:
    """This rank's flat fp32 partitions, the tensors DeepSpeed's inner optimizer keeps its state under."""
    name = next(name for name in _FP32_PARTITIONS if hasattr(zero, name))
    return list(getattr(zero, name))


def flat_groups(zero: Any) -> list[FlatGroup]:
    """This rank's fp32 partitions, as DeepSpeed's optimizer hands them to the inner optimizer, and where each
    parameter lies in them: ZeRO-1/2's partitions of each group's parameters laid end to end, or ZeRO-3's
    partitions of each parameter laid end to end per sub-group."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):
        return _stage3_groups(zero)
    if hasattr(zero, "single_partition_of_fp32_groups"):
        return _stage12_groups(zero)
    # DeepSpeed picks BF16_Optimizer for zero1 + bf16 with data_types.grad_accum_dtype="fp32": another layout
    raise ConfigurationError(
        f"DeepSpeed wrapped the optimizer in {type(zero).__name__}, whose partitions lightscale cannot map to "
        "parameters, so Muon (FlatMuon) cannot step them. DeepSpeed chooses it for zero1 with bf16 and "
        '"data_types": {"grad_accum_dtype": "fp32"}: remove that setting, or use zero2 / zero3 / fsdp2.'
    )


def _stage12_groups(zero: Any) -> list[FlatGroup]:
    """ZeRO-1/2 lays a group's parameters end to end (in ``round_robin_bit16_groups`` order, at
    ``round_robin_bit16_offsets``, alignment padding between them) in one flat buffer padded to a multiple of the
    ranks, and rank r holds elements [r P, (r + 1) P) of it, P = ``partition_size``; the fp32 copy of that slice is
    what the inner optimizer steps (``single_partition_of_fp32_groups``)."""
    groups = []
    for index, partition in enumerate(zero.single_partition_of_fp32_groups):
        process_group = zero.real_dp_process_group[index]
        ranks, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        size = int(zero.partition_size[index])
        shapes = [meta.shape for meta in zero.round_robin_bit16_meta[index]]
        offsets = zero.round_robin_bit16_offsets[index]
        spans = tuple(_span(shape, start, size, ranks, rank) for shape, start in zip(shapes, offsets, strict=True))
        device = zero.bit16_groups_flat[index].device  # collectives run where the model's bit16 copy lives
        groups.append(FlatGroup(partition, spans, process_group, rank, device, index))
    return groups


def _span(shape: torch.Size, start: int, partition_size: int, ranks: int, rank: int) -> FlatSpan:
    """The parameter at ``start`` of the flat buffer: its elements in each rank's [r P, (r + 1) P)."""
    end = start + shape.numel()
    sizes = tuple(max(0, min(end, (r + 1) * partition_size) - max(start, r * partition_size)) for r in range(ranks))
    return FlatSpan(shape, sizes, max(start - rank * partition_size, 0))


def _stage3_groups(zero: Any) -> list[FlatGroup]:
    """ZeRO-3 partitions each parameter on its own: rank r holds elements [r p, (r + 1) p) of it, p =
    ``ceil(numel / ranks)`` (``partition_numel``; the last rank's piece padded), and a sub-group's fp32 partition is
    its parameters' pieces end to end (``fp32_partitioned_groups_flat``, in ``fp16_groups`` order), persistent
    parameters included."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())  # the pieces travel on the accelerator
    groups = []
    for index, partition in enumerate(zero.fp32_partitioned_groups_flat):
        process_group = zero.sub_group_process_groups[index]
        ranks, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        spans, offset = [], 0
        for param in zero.fp16_groups[index]:
            piece, numel = param.partition_numel(), full_numel(param)
            sizes = tuple(max(0, min(numel, (r + 1) * piece) - r * piece) for r in range(ranks))
            spans.append(FlatSpan(full_shape(param), sizes, offset))
            offset += piece
        group_index = int(zero.sub_group_to_group_id[index])
        groups.append(FlatGroup(partition, tuple(spans), process_group, rank, device, group_index))
    return groups
