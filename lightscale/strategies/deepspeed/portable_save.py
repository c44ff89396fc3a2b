"""Saving ZeRO state as the one portable checkpoint layout (lightscale/checkpoint/portable.py), and the ZeRO
optimizer's state by parameter name that the load side (lightscale/strategies/deepspeed/load_portable.py) reads too.

Save: each parameter's full fp32 master weight and optimizer state are gathered with DeepSpeed's public
``safe_get_full_*`` calls (collective: every rank takes part in every gather), but only the parameter's *owner*
(parameter index modulo world size, round robin) keeps the gathered tensors in the state dict it hands to DCP.
DCP merges the ranks' plans, so each tensor is written once, and no rank ever holds more than its share of the
model and moments plus the one parameter being gathered. bf16 runs save the fp32 masters, as fp32 runs do.

Any torch optimizer: its state is whatever the inner optimizer keeps for each flat fp32 partition. A tensor of the
partition's shape holds one value per element (Adam's moments, SGD's momentum buffer, Adagrad's sum, RMSprop's
square average) and is saved per parameter as ``state.<fqn>.<key>``, as FSDP2 saves it; a scalar (a step counter) is
the same for every partition, since ZeRO steps them together, and is saved once per parameter too.

Load (strategies/deepspeed/load_portable.py): the checkpoint (saved by any strategy on any number of ranks) is read a
bounded batch of parameters at a time (whole tensors, :data:`LOAD_BATCH_NUMEL` elements per batch) and written into the
engine's partitions (deepspeed/partition_writes.py: DeepSpeed's setters, this rank's padded piece under ZeRO-3);
the working copies are then refreshed from the masters, and the scalar states and hyper-parameters (lr, betas, ...) of
each group are set. The keys come from the checkpoint: state the optimizer has not created yet (no step taken) is
created first.

Example:
    >>> state = zero_state_dict(engine, module, group_names)            # collective, on every rank
    >>> write_checkpoint(path, state, trainer_state, save_file)         # the layout FSDP2 and parallel_3d write
    >>> load_zero_state_dict(path, engine, module, group_names, optimizer=True)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightscale.errors import ConfigurationError
from lightscale.patches.deepspeed import relink_optimizer_states
from lightscale.strategies.deepspeed.partition import fp32_partitions


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


# ---- the optimizer's state ----------------------------------------------------------------------------------
def optimizer_state(zero: Any) -> tuple[list[str], dict[str, Tensor]]:
    """The inner optimizer's per-element state keys and its scalar states (as fp32 tensors), any torch optimizer,
    over all its groups (:func:`group_states` gives them per group)."""
    groups = group_states(zero)
    scalars: dict[str, Tensor] = {}
    for _, values in groups:
        for key, value in values.items():
            scalars.setdefault(key, value)
    return sorted({key for keys, _ in groups for key in keys}), scalars


def group_states(zero: Any) -> list[tuple[list[str], dict[str, Tensor]]]:
    """Per optimizer group, its per-element state keys and scalar states: the same in every group of one torch
    optimizer, a part's own in a combination (Muon's momentum, AdamW's moments and step).

    Links ZeRO-1/2's per-parameter views first, so ``safe_get_full_optimizer_state`` reads every key returned.
    """
    materialize_optimizer_state(zero)
    inner = zero.optimizer
    elementwise: list[set[str]] = [set() for _ in inner.param_groups]
    scalars: list[dict[str, Tensor]] = [{} for _ in inner.param_groups]
    for index, flat in enumerate(fp32_partitions(zero)):
        group = partition_group(zero, index)
        for key, value in inner.state.get(flat, {}).items():
            if torch.is_tensor(value) and value.shape == flat.shape:
                elementwise[group].add(key)
            elif _is_scalar(value):
                scalars[group].setdefault(key, torch.as_tensor(value, dtype=torch.float32).detach().cpu().clone())
            elif value is not None:
                raise ConfigurationError(
                    f"{type(inner).__name__} keeps state {key!r} of shape {tuple(getattr(value, 'shape', ()))}, "
                    f"neither one value per element of its flat ZeRO partition {tuple(flat.shape)} nor a scalar: it "
                    "cannot be split into parameters for the portable checkpoint. Use checkpoint_format='deepspeed'."
                )
    return [(sorted(keys), values) for keys, values in zip(elementwise, scalars, strict=True)]


def partition_group(zero: Any, index: int) -> int:
    """The optimizer group flat partition ``index`` belongs to: ZeRO-1/2 make one per group, ZeRO-3 sub-groups."""
    return int(zero.sub_group_to_group_id[index]) if hasattr(zero, "sub_group_to_group_id") else index


def _is_scalar(value: Any) -> bool:
    if torch.is_tensor(value):
        return value.dim() == 0
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- save ---------------------------------------------------------------------------------------------------
def zero_state_dict(engine: Any, module: nn.Module, group_names: list[list[str]]) -> dict[str, Any]:
    """This rank's share of ``{"model": ..., "optimizer": ...}`` in the portable layout (collective)."""
    optimizer = zero_optimizer(engine)
    groups = group_states(optimizer) if optimizer is not None else []
    group_of = {name: index for index, names in enumerate(group_names) for name in names}
    owned: dict[int, str] = {}
    model: dict[str, Tensor] = {}
    flat: dict[str, Any] = {}
    for index, (name, param) in enumerate(unique_parameters(module)):
        mine = index % _world() == _rank()
        weight = _full_weight(param, optimizer)
        trained = optimizer is not None and param.requires_grad and name in group_of
        keys = groups[group_of[name]][0] if trained else []
        state = {key: _full_state(param, key) for key in keys}
        if mine:
            owned[id(param)] = name
            model[name] = weight
            flat.update({f"state.{name}.{key}": value for key, value in state.items()})
    for name, tensor in module.state_dict(keep_vars=True).items():  # tied aliases and buffers
        if name in model or not _writes(tensor, owned):
            continue
        model[name] = model[owned[id(tensor)]] if id(tensor) in owned else tensor.detach().cpu().clone()
    if optimizer is not None:
        flat.update(_group_entries(optimizer, group_names, set(owned.values()), [values for _, values in groups]))
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


def _group_entries(
    optimizer: Any, group_names: list[list[str]], owned: set[str], group_scalars: list[dict[str, Tensor]]
) -> dict[str, Any]:
    """``state.<fqn>.<scalar>`` (step counters) and ``param_groups.<fqn>.<hyper-parameter>`` of the owned parameters."""
    entries: dict[str, Any] = {}
    groups = optimizer.optimizer.param_groups
    for group, names, scalars in zip(groups, group_names, group_scalars, strict=True):
        settings = {key: value for key, value in group.items() if key != "params" and not key.startswith("_")}
        for name in (name for name in names if name in owned):
            entries.update({f"state.{name}.{key}": value.clone() for key, value in scalars.items()})
            entries.update({f"param_groups.{name}.{key}": value for key, value in settings.items()})
    return entries


# ---- load ---------------------------------------------------------------------------------------------------
def materialize_optimizer_state(zero: Any, by_group: Sequence[tuple[Iterable[str], Iterable[str]]] = ()) -> None:
    """Create the per-element (zeros) and scalar (0) states ``by_group[g]`` names for group ``g`` that a flat fp32
    partition of that group does not hold yet, then link ZeRO-1/2's per-parameter views of every state.

    Torch optimizers create their state at the first step (Adagrad at construction); a checkpoint is loaded before
    it, and DeepSpeed's setters write into that state. The checkpoint's values then replace the zeros.
    """
    inner = zero.optimizer
    int_steps = type(inner).__name__ == "DeepSpeedCPUAdam"  # counts its steps in a Python int
    for index, flat in enumerate(fp32_partitions(zero)) if by_group else []:
        elementwise, scalars = by_group[partition_group(zero, index)]
        state = inner.state[flat]
        for key in (key for key in elementwise if key not in state):
            state[key] = torch.zeros_like(flat)
        for key in (key for key in scalars if key not in state):
            state[key] = 0 if int_steps else torch.tensor(0.0, dtype=torch.float32)
    relink_optimizer_states(zero)  # ZeRO-1/2 linked the first group only (lightscale/patches/deepspeed.py)


def group_parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each optimizer group, recorded before DeepSpeed replaces the groups' parameters by
    its flat partitions; group ``i`` of DeepSpeed's inner optimizer is the user's group ``i``."""
    names = {id(param): name for name, param in unique_parameters(module)}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]
