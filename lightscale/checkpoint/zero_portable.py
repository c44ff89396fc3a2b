"""ZeRO state in the one portable checkpoint layout (lightscale/checkpoint/layout.py), both ways.

Save: each parameter's full fp32 master weight and Adam moments are gathered with DeepSpeed's public
``safe_get_full_*`` calls (collective: every rank takes part in every gather), but only the parameter's *owner*
(parameter index modulo world size, round robin) keeps the gathered tensors in the state dict it hands to DCP.
DCP merges the ranks' plans, so each tensor is written once, and no rank ever holds more than its share of the
model and moments plus the one parameter being gathered. bf16 runs save the fp32 masters, as fp32 runs do.

Load: the checkpoint (saved by any strategy on any number of ranks) is read a bounded batch of parameters at a
time (whole tensors, :data:`LOAD_BATCH_NUMEL` elements per batch) and written into the engine's partitions with
``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``; the working (bit16 or fp32) copies are then
refreshed from the masters, and the step and hyper-parameters (lr, betas, ...) of each optimizer group are set.

Example:
    >>> state = zero_state_dict(engine, module, group_names)            # collective, on every rank
    >>> write_checkpoint(path, state, trainer_state, save_file)         # the layout FSDP2 and parallel_3d write
    >>> load_zero_state_dict(path, engine, module, group_names, optimizer=True)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightscale.checkpoint.layout import read_checkpoint

MOMENTS = ("exp_avg", "exp_avg_sq")
LOAD_BATCH_NUMEL = 1 << 26  # elements of parameters read per batch at load (x3 with both moments, fp32)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def unique_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters, each once under its first name: the keys of torch's flattened optimizer state dict."""
    return list(module.named_parameters())


def zero_optimizer(engine: Any) -> Any | None:
    """DeepSpeed's ZeRO optimizer wrapper, or None (evaluation engines have none or a parameter-offload stub)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or not hasattr(optimizer, "optimizer") or not hasattr(optimizer, "param_groups"):
        return None
    return optimizer


# ---- save ---------------------------------------------------------------------------------------------------
def zero_state_dict(engine: Any, module: nn.Module, group_names: list[list[str]]) -> dict[str, Any]:
    """This rank's share of ``{"model": ..., "optimizer": ...}`` in the portable layout (collective)."""
    optimizer = zero_optimizer(engine)
    if optimizer is not None:
        materialize_optimizer_state(optimizer)  # links ZeRO-1/2's per-parameter views of the moments
    owned: dict[int, str] = {}
    model: dict[str, Tensor] = {}
    flat: dict[str, Any] = {}
    for index, (name, param) in enumerate(unique_parameters(module)):
        mine = index % _world() == _rank()
        weight = _full_weight(param, optimizer)
        trained = optimizer is not None and param.requires_grad
        moments = {key: _full_state(param, key) for key in MOMENTS} if trained else {}
        if mine:
            owned[id(param)] = name
            model[name] = weight
            flat.update({f"state.{name}.{key}": value for key, value in moments.items()})
    for name, tensor in module.state_dict(keep_vars=True).items():  # tied aliases and buffers
        if name in model or not _writes(tensor, owned):
            continue
        model[name] = model[owned[id(tensor)]] if id(tensor) in owned else tensor.detach().cpu().clone()
    if optimizer is not None:
        flat.update(_group_entries(optimizer, group_names, set(owned.values())))
    return {"model": model, "optimizer": flat} if optimizer is not None else {"model": model}


def _writes(tensor: Tensor, owned: dict[int, str]) -> bool:
    if isinstance(tensor, nn.Parameter):
        return id(tensor) in owned
    return _rank() == 0  # buffers are replicated under ZeRO: rank 0 writes them


def _full_weight(param: nn.Parameter, optimizer: Any | None) -> Tensor:
    from deepspeed.utils import safe_get_full_fp32_param

    master = safe_get_full_fp32_param(param) if optimizer is not None else None
    if master is not None:
        return master.detach().cpu().clone()
    return _gathered(param).float()


def _full_state(param: nn.Parameter, key: str) -> Tensor:
    from deepspeed.utils import safe_get_full_optimizer_state

    return safe_get_full_optimizer_state(param, key).detach().cpu().clone()


def _gathered(param: nn.Parameter) -> Tensor:
    if not hasattr(param, "ds_id"):
        return param.detach().cpu().clone()
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().cpu().clone()


def _group_entries(optimizer: Any, group_names: list[list[str]], owned: set[str]) -> dict[str, Any]:
    """``state.<fqn>.step`` and ``param_groups.<fqn>.<hyper-parameter>`` of the owned parameters."""
    step = torch.tensor(float(optimizer_step(optimizer)), dtype=torch.float32)
    entries: dict[str, Any] = {}
    for group, names in zip(optimizer.optimizer.param_groups, group_names, strict=True):
        settings = {key: value for key, value in group.items() if key != "params" and not key.startswith("_")}
        for name in (name for name in names if name in owned):
            entries[f"state.{name}.step"] = step.clone()
            entries.update({f"param_groups.{name}.{key}": value for key, value in settings.items()})
    return entries


def optimizer_step(optimizer: Any) -> int:
    """The optimizer steps taken: torch's Adam/AdamW keep ``step`` as a tensor, DeepSpeed's CPU Adam as an int,
    each in the state of every flat fp32 partition (all equal: ZeRO steps every partition together)."""
    steps = [state["step"] for state in optimizer.optimizer.state.values() if "step" in state]
    return int(steps[0]) if steps else 0


# ---- load ---------------------------------------------------------------------------------------------------
def load_zero_state_dict(
    path: Path, engine: Any, module: nn.Module, group_names: list[list[str]], *, optimizer: bool
) -> Path:
    """Collectively fill the engine from the portable checkpoint ``path``; returns the directory read."""
    zero = zero_optimizer(engine) if optimizer else None
    if zero is not None:
        materialize_optimizer_state(zero)
    params = unique_parameters(module)
    for batch in _batches(params):
        path = _load_batch(path, batch, zero)
    _load_buffers(path, module)
    if zero is not None:
        _refresh_working_copies(zero)
        _load_groups(path, zero, group_names)
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
    return int(getattr(param, "ds_numel", param.numel()))


def _shape(param: nn.Parameter) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)


def _load_batch(path: Path, batch: list[tuple[str, nn.Parameter]], zero: Any | None) -> Path:
    model = {name: torch.empty(_shape(param), dtype=torch.float32) for name, param in batch}
    state: dict[str, Any] = {"model": model}
    if zero is not None:
        state["optimizer"] = {
            f"state.{name}.{key}": torch.empty(_shape(param), dtype=torch.float32)
            for name, param in batch
            if param.requires_grad  # frozen parameters have no optimizer state in any checkpoint
            for key in MOMENTS
        }
    path = read_checkpoint(path, state)
    for name, param in batch:
        _set_weight(param, model[name], zero)
        if zero is not None and param.requires_grad:
            _set_moments(param, {key: state["optimizer"][f"state.{name}.{key}"] for key in MOMENTS})
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
    return param.ds_tensor.device if hasattr(param, "ds_tensor") else param.device


def _set_moments(param: nn.Parameter, moments: dict[str, Tensor]) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    for key, value in moments.items():
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


def materialize_optimizer_state(zero: Any) -> None:
    """Create zero moments and step 0 for every flat fp32 partition that has no state yet.

    Adam creates its state at the first step; a checkpoint is loaded before it, and DeepSpeed's setters write
    into that state. Step 0 with zero moments is exactly the state Adam would create.
    """
    inner = zero.optimizer
    cpu_adam = type(inner).__name__ == "DeepSpeedCPUAdam"
    for flat in _flat_partitions(zero):
        if not inner.state[flat]:
            step: Any = 0 if cpu_adam else torch.tensor(0.0, dtype=torch.float32)
            inner.state[flat] = {"step": step, **{key: torch.zeros_like(flat) for key in MOMENTS}}
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 link each parameter to views of its moments once, after stepping the first group only: the
        # other groups' links stay empty. Linking again (views of the same tensors) makes every link whole.
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


# The flat fp32 partitions the inner optimizer steps, by ZeRO optimizer: ZeRO-3, ZeRO-1/2, and ZeRO-1 in bf16
# (DeepSpeed's BF16_Optimizer).
_FLAT_PARTITIONS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def _flat_partitions(zero: Any) -> list[Tensor]:
    name = next(name for name in _FLAT_PARTITIONS if hasattr(zero, name))
    return list(getattr(zero, name))


def _refresh_working_copies(zero: Any) -> None:
    if hasattr(zero, "update_lp_params"):  # ZeRO-1/2: copy masters into the bit16 partitions and all-gather them
        zero.update_lp_params()


def _load_groups(path: Path, zero: Any, group_names: list[list[str]]) -> Path:
    """The step and the hyper-parameters of each group, from its first parameter's entries."""
    groups = zero.optimizer.param_groups
    template: dict[str, Any] = {}
    for group, names in zip(groups, group_names, strict=True):
        template[f"state.{names[0]}.step"] = torch.zeros((), dtype=torch.float32)
        template.update({f"param_groups.{names[0]}.{key}": None for key in _hyper_parameters(group)})
    path = read_checkpoint(path, {"optimizer": template})
    step = int(template[f"state.{group_names[0][0]}.step"].item())
    for group, names in zip(groups, group_names, strict=True):
        group.update({key: template[f"param_groups.{names[0]}.{key}"] for key in _hyper_parameters(group)})
    set_optimizer_step(zero, step)
    return path


def _hyper_parameters(group: dict[str, Any]) -> list[str]:
    return [key for key in ("lr", "initial_lr", "betas", "eps", "weight_decay") if key in group]


def set_optimizer_step(zero: Any, step: int) -> None:
    inner = zero.optimizer
    for flat in _flat_partitions(zero):
        state = inner.state[flat]
        state["step"] = torch.tensor(float(step), dtype=torch.float32) if torch.is_tensor(state["step"]) else step


def group_parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each optimizer group, recorded before DeepSpeed replaces the groups' parameters by
    its flat partitions; group ``i`` of DeepSpeed's inner optimizer is the user's group ``i``."""
    names = {id(param): name for name, param in unique_parameters(module)}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]
