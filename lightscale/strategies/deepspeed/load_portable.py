"""Loading a portable checkpoint into a ZeRO engine (the save side: lightscale/strategies/deepspeed/portable_save.py).

A bounded batch of whole parameters at a time (:data:`LOAD_BATCH_NUMEL` elements) is read and written into the engine's
partitions (deepspeed/partition_writes.py: DeepSpeed's own setters); the working copies are then refreshed from
the masters, and each group's scalar states and hyper-parameters are set. This module reads the layout; every DeepSpeed
attribute it needs is asked of lightscale/zero/.

Example:
    >>> load_zero_state_dict(path, engine, module, group_names, optimizer=True)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightscale.checkpoint.portable import layout_entries, read_checkpoint
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.strategies.deepspeed.partition import whole_numel, whole_shape
from lightscale.strategies.deepspeed.partition_writes import (
    refresh_working_copies,
    set_full_state,
    set_full_weight,
    set_scalars,
)
from lightscale.strategies.deepspeed.portable_save import materialize_optimizer_state, unique_parameters, zero_optimizer

LOAD_BATCH_NUMEL = 1 << 26  # elements of parameters read per batch at load (x3 with Adam's two moments, fp32)


class SavedState:
    """The optimizer state keys of a checkpoint, from its metadata: per-element keys (one value per element of the
    parameter) and scalar keys (step counters) of each parameter, and which group settings it holds."""

    def __init__(self, path: Path, params: list[tuple[str, nn.Parameter]]) -> None:
        entries = layout_entries(path)
        self.entries = set(entries)
        shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        for key, meta in entries.items():
            if key.startswith("optimizer.state.") and isinstance(meta, TensorStorageMetadata):
                name, state_key = key[len("optimizer.state.") :].rsplit(".", 1)
                shapes.setdefault(name, {})[state_key] = tuple(meta.size)
        self.keys = {name: set(keys) for name, keys in shapes.items()}
        shape_of = {name: tuple(whole_shape(param)) for name, param in params}
        saved = [(name, key, shape) for name, keys in shapes.items() for key, shape in keys.items()]
        # A 0-d entry of a parameter with elements is a scalar; of a 0-d parameter, only ``step`` is taken as one.
        self.scalars = {
            key for name, key, shape in saved if shape == () and (shape_of.get(name, ()) != () or key == "step")
        }
        self.elementwise = sorted({key for _, key, _ in saved} - self.scalars)

    def by_group(self, group_names: list[list[str]]) -> list[tuple[list[str], list[str]]]:
        """Each group's per-element and scalar keys (a combination's parts keep different ones)."""
        keys = [set().union(*(self.keys.get(name, set()) for name in names)) for names in group_names]
        return [(sorted(held - self.scalars), sorted(held & self.scalars)) for held in keys]

    def of(self, name: str, keys: Iterable[str]) -> list[str]:
        """Those of ``keys`` the checkpoint holds for parameter ``name``."""
        return sorted(set(keys) & self.keys.get(name, set()))


def load_zero_state_dict(
    path: Path, engine: Any, module: nn.Module, group_names: list[list[str]], *, optimizer: bool
) -> Path:
    """Collectively fill the engine from the portable checkpoint ``path``; returns the directory read."""
    zero = zero_optimizer(engine) if optimizer else None
    params = unique_parameters(module)
    saved = SavedState(complete_checkpoint(path), params) if zero is not None else None
    if zero is not None and saved is not None:
        materialize_optimizer_state(zero, saved.by_group(group_names))
    for batch in _batches(params):
        path = _load_batch(path, batch, zero, saved)
    _load_buffers(path, module)
    if zero is not None and saved is not None:
        refresh_working_copies(zero)
        _load_groups(path, zero, group_names, saved)
    return path


def _batches(params: list[tuple[str, nn.Parameter]]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    batch: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, param in params:
        batch.append((name, param))
        size += whole_numel(param)
        if size >= LOAD_BATCH_NUMEL:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _load_batch(path: Path, batch: list[tuple[str, nn.Parameter]], zero: Any | None, saved: SavedState | None) -> Path:
    model = {name: torch.empty(whole_shape(param), dtype=torch.float32) for name, param in batch}
    state: dict[str, Any] = {"model": model}
    # Frozen parameters have no optimizer state in any checkpoint.
    keys = {name: saved.of(name, saved.elementwise) if saved and param.requires_grad else [] for name, param in batch}
    if zero is not None:
        state["optimizer"] = {
            f"state.{name}.{key}": torch.empty(whole_shape(param), dtype=torch.float32)
            for name, param in batch
            for key in keys[name]
        }
    path = read_checkpoint(path, state)
    for name, param in batch:
        set_full_weight(param, model[name], zero)
        if zero is not None:
            set_full_state(param, {key: state["optimizer"][f"state.{name}.{key}"] for key in keys[name]})
    return path


def _load_buffers(path: Path, module: nn.Module) -> Path:
    named = dict(module.named_parameters())
    buffers = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items() if name not in named}
    buffers = {name: tensor for name, tensor in buffers.items() if not isinstance(tensor, nn.Parameter)}
    if not buffers:
        return path
    template = {name: torch.empty_like(tensor, device="cpu") for name, tensor in buffers.items()}
    path = read_checkpoint(path, {"model": template})
    with torch.no_grad():
        for name, tensor in buffers.items():
            tensor.copy_(template[name])
    return path


def _load_groups(path: Path, zero: Any, group_names: list[list[str]], saved: SavedState) -> Path:
    """Each group's scalar states and hyper-parameters (from its first parameter's entries), those the checkpoint
    holds."""
    groups = zero.optimizer.param_groups
    firsts = [names[0] if names else "" for names in group_names]
    template: dict[str, Any] = {
        f"state.{first}.{key}": torch.zeros(()) for first in firsts for key in saved.of(first, saved.scalars)
    }
    settings = [
        [key for key in _hyper_parameters(group) if f"optimizer.param_groups.{names[0]}.{key}" in saved.entries]
        for group, names in zip(groups, group_names, strict=True)
    ]
    for keys, names in zip(settings, group_names, strict=True):
        template.update({f"param_groups.{names[0]}.{key}": None for key in keys})
    path = read_checkpoint(path, {"optimizer": template})
    for group, keys, names in zip(groups, settings, group_names, strict=True):
        group.update({key: template[f"param_groups.{names[0]}.{key}"] for key in keys})
    scalars = [{key: template[f"state.{first}.{key}"] for key in saved.of(first, saved.scalars)} for first in firsts]
    set_scalars(zero, scalars)
    return path


def _hyper_parameters(group: dict[str, Any]) -> list[str]:
    """The settings a scheduler may change (OneCycleLR cycles ``momentum`` or ``betas``)."""
    return [key for key in ("lr", "initial_lr", "betas", "momentum", "eps", "weight_decay") if key in group]
