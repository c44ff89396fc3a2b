"""Loading a portable checkpoint into a ZeRO engine (the save side: lightscale/zero/portable.py).

A bounded batch of whole parameters at a time (:data:`LOAD_BATCH_NUMEL` elements) is read and written into the
engine's partitions with ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``; the working copies are
then refreshed from the masters, and each group's scalar states and hyper-parameters are set.

Example:
    >>> load_zero_state_dict(path, engine, module, group_names, optimizer=True)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightscale.checkpoint.portable import layout_entries, read_checkpoint
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.zero.partition import full_numel, full_shape, is_partitioned, partition
from lightscale.zero.portable import (
    _flat_partitions,
    _rank,
    materialize_optimizer_state,
    unique_parameters,
    zero_optimizer,
)

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
        shape_of = {name: tuple(_shape(param)) for name, param in params}
        saved = [(name, key, shape) for name, keys in shapes.items() for key, shape in keys.items()]
        # A 0-d entry of a parameter with elements is a scalar; of a 0-d parameter, only ``step`` is taken as one.
        self.scalars = {
            key for name, key, shape in saved if shape == () and (shape_of.get(name, ()) != () or key == "step")
        }
        self.elementwise = sorted({key for _, key, _ in saved} - self.scalars)

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
        materialize_optimizer_state(zero, saved.elementwise, saved.scalars)
    for batch in _batches(params):
        path = _load_batch(path, batch, zero, saved)
    _load_buffers(path, module)
    if zero is not None and saved is not None:
        _refresh_working_copies(zero)
        _load_groups(path, zero, group_names, saved)
    return path


def _batches(params: list[tuple[str, nn.Parameter]]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    batch: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, param in params:
        batch.append((name, param))
        size += _numel(param)
        if size >= LOAD_BATCH_NUMEL:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _numel(param: nn.Parameter) -> int:
    return full_numel(param) if is_partitioned(param) else param.numel()


def _shape(param: nn.Parameter) -> torch.Size:
    return full_shape(param) if is_partitioned(param) else param.shape


def _load_batch(path: Path, batch: list[tuple[str, nn.Parameter]], zero: Any | None, saved: SavedState | None) -> Path:
    model = {name: torch.empty(_shape(param), dtype=torch.float32) for name, param in batch}
    state: dict[str, Any] = {"model": model}
    # Frozen parameters have no optimizer state in any checkpoint.
    keys = {name: saved.of(name, saved.elementwise) if saved and param.requires_grad else [] for name, param in batch}
    if zero is not None:
        state["optimizer"] = {
            f"state.{name}.{key}": torch.empty(_shape(param), dtype=torch.float32)
            for name, param in batch
            for key in keys[name]
        }
    path = read_checkpoint(path, state)
    for name, param in batch:
        _set_weight(param, model[name], zero)
        if zero is not None:
            _set_state(param, {key: state["optimizer"][f"state.{name}.{key}"] for key in keys[name]})
    return path


def _set_weight(param: nn.Parameter, value: Tensor, zero: Any | None) -> None:
    from deepspeed.utils import safe_set_full_fp32_param

    if zero is not None and param.requires_grad:
        safe_set_full_fp32_param(param, value.to(_master_device(param)))
    if hasattr(param, "ds_id"):  # ZeRO-3: the working partition, rewritten from rank 0's copy
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if _rank() == 0:
                param.data.copy_(value)
    elif zero is None or not param.requires_grad:
        with torch.no_grad():
            param.data.copy_(value)  # ZeRO-1/2 working copies are refreshed from the masters after all batches


def _master_device(param: nn.Parameter) -> torch.device:
    return partition(param).device if is_partitioned(param) else param.device


def _set_state(param: nn.Parameter, state: dict[str, Tensor]) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    for key, value in state.items():
        safe_set_full_optimizer_state(param, value.to(_master_device(param)), key)


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


# The flat fp32 partitions the inner optimizer steps, by ZeRO optimizer: ZeRO-3, ZeRO-1/2, and ZeRO-1 in bf16
# (DeepSpeed's BF16_Optimizer).
def _refresh_working_copies(zero: Any) -> None:
    if hasattr(zero, "update_lp_params"):  # ZeRO-1/2: copy masters into the bit16 partitions and all-gather them
        zero.update_lp_params()


def _load_groups(path: Path, zero: Any, group_names: list[list[str]], saved: SavedState) -> Path:
    """The scalar states (from the first parameter's entries) and each group's hyper-parameters (from its first
    parameter's), those the checkpoint holds."""
    groups = zero.optimizer.param_groups
    first = group_names[0][0]
    template: dict[str, Any] = {f"state.{first}.{key}": torch.zeros(()) for key in saved.of(first, saved.scalars)}
    settings = [
        [key for key in _hyper_parameters(group) if f"optimizer.param_groups.{names[0]}.{key}" in saved.entries]
        for group, names in zip(groups, group_names, strict=True)
    ]
    for keys, names in zip(settings, group_names, strict=True):
        template.update({f"param_groups.{names[0]}.{key}": None for key in keys})
    path = read_checkpoint(path, {"optimizer": template})
    for group, keys, names in zip(groups, settings, group_names, strict=True):
        group.update({key: template[f"param_groups.{names[0]}.{key}"] for key in keys})
    scalars = {key: template[f"state.{first}.{key}"] for key in saved.of(first, saved.scalars)}
    _set_scalars(zero, scalars)
    return path


def _hyper_parameters(group: dict[str, Any]) -> list[str]:
    """The settings a scheduler may change (OneCycleLR cycles ``momentum`` or ``betas``)."""
    return [key for key in ("lr", "initial_lr", "betas", "momentum", "eps", "weight_decay") if key in group]


def _set_scalars(zero: Any, scalars: dict[str, Tensor]) -> None:
    """Each scalar state of every flat partition, in the type the optimizer keeps it (tensor or Python number)."""
    inner = zero.optimizer
    for flat in _flat_partitions(zero):
        state = inner.state[flat]
        for key, value in scalars.items():
            live = state[key]  # each partition its own tensor: optimizers count steps in place
            state[key] = (
                value.to(live.device, live.dtype).clone() if torch.is_tensor(live) else type(live)(value.item())
            )
