"""Any lightscale checkpoint as Lightning's own single-file checkpoint dictionary, in one process, no process group.

What Lightning's loaders expect from ``torch.load(path)`` (``load_from_checkpoint``, ``Trainer(...).fit/validate(
ckpt_path=...)``) is built from the directory a strategy wrote:

* ``state_dict``: the LightningModule's own keys, full tensors (DCP's ``model.*`` entries: every strategy's weights,
  DiLoCo's global model; or DeepSpeed's ``zero_to_fp32`` for ``checkpoint_format="deepspeed"`` directories);
* everything else Lightning saved (loops, callbacks, LR schedulers, ``hyper_parameters``) from ``trainer_state.pt``
  or DeepSpeed's client state;
* ``optimizer_states`` (only when asked): torch's ``Optimizer.state_dict()`` per optimizer, parameters numbered in
  the order of the groups the writer recorded in ``trainer_state.pt`` (``lightscale.optimizers``: the class and the
  parameter names of each group, :func:`describe_optimizers`); the layout itself keys state by parameter name;
* ``lightscale``: the writer and ``consolidated`` (the recorded optimizers, or why no optimizer state is given),
  which :func:`check_optimizers` compares with the optimizers of the run that loads it.

Nothing read runs code: ``.metadata`` through safe_dcp.py's restricted unpickler, tensors and every other entry
weights-only, DeepSpeed's files through its weights-only loader. Memory: the full weights plus the tensor being read
(DCP reads one saved piece at a time into the full tensors); the optimizer state only when asked for.

Example:
    >>> checkpoint = lightning_checkpoint(Path("ckpt/last.ckpt"))  # what torch.load gives for a single file
    >>> module.load_state_dict(checkpoint["state_dict"])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightscale.checkpoint.averaged import AVERAGED_META, to_lightning_convention
from lightscale.checkpoint.deepspeed_dir import (
    CHECKPOINT_TAG,
    consolidate_zero_checkpoint,
    model_states_file,
    safe_load,
)
from lightscale.checkpoint.portable import TRAINER_STATE, check_checkpoint_dir, full_model_state_dict
from lightscale.errors import ConfigurationError
from lightscale.storage.safe_dcp import load_safely, safe_reader
from lightscale.storage.safe_io import load_weights_only
from lightscale.storage.staged_copy import local_directory
from lightscale.storage.urls import Location, checkpoint_location

MapLocation = Callable[..., Any] | str | torch.device | dict[str, str] | None
_OPTIMIZER = "optimizer."
_UNKNOWN = "?"  # the name of an optimized parameter that is not the module's
# What DeepSpeed writes beside Lightning's client state in its model-states file (not part of Lightning's checkpoint).
_DEEPSPEED_KEYS = frozenset(
    (
        *("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params"),
        *("frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names"),
        *("skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config"),
        *("ds_version", "universal_checkpoint_info"),
    )
)


# ---- what a writer records ------------------------------------------------------------------------------------
def describe_optimizers(module: nn.Module, optimizers: Iterable[Optimizer]) -> list[dict[str, Any]] | None:
    """Per optimizer its class name and the parameter names of each group, in the optimizer's order (collective
    under a process group: pipeline stages hold different parameters, so every rank's names are merged in rank
    order). Stored in ``trainer_state.pt``; it numbers the layout's name-keyed state the way torch's does."""
    mine = _describe_local(module, optimizers)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        mine = merge_descriptions(every)
    named = all(_UNKNOWN not in names for optimizer in mine for names in optimizer["groups"])
    return mine if named else None  # a parameter outside the module: its state cannot be named


def merge_descriptions(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One description from every rank's: each group's names in rank order, each name once."""
    merged: list[dict[str, Any]] = []
    for described in per_rank:
        for index, optimizer in enumerate(described):
            if index == len(merged):
                merged.append({"class": optimizer["class"], "groups": []})
            groups = merged[index]["groups"]
            for group_index, names in enumerate(optimizer["groups"]):
                if group_index == len(groups):
                    groups.append([])
                groups[group_index].extend(name for name in names if name not in groups[group_index])
    return merged


# ---- reading ---------------------------------------------------------------------------------------------------
def is_lightscale_directory(path: Location) -> bool:
    """A portable layout directory or a DeepSpeed engine directory written by a ZeRO strategy."""
    return path.is_dir() and ((path / ".metadata").is_file() or (path / CHECKPOINT_TAG).is_dir())


def lightning_checkpoint(
    path: str | os.PathLike | Location,
    *,
    optimizer: bool = False,
    averaged: bool = True,
    map_location: MapLocation = None,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """The Lightning checkpoint dictionary of the lightscale checkpoint directory ``path`` (see the module docstring).

    ``weights_only=False`` (an explicit opt-in, as for Lightning's own files) lets ``trainer_state.pt`` hold classes
    outside the allow-list; tensors are read safely either way. A ``WeightAveraging`` average is given as Lightning's
    callback writes it (``state_dict`` the average, ``current_model_state`` the raw weights: checkpoint/averaged.py);
    ``averaged=False`` leaves it out (``state_dict`` the raw weights).
    """
    path = checkpoint_location(path)
    if (path / CHECKPOINT_TAG).is_dir():
        checkpoint = _from_deepspeed(path)
    else:
        check_checkpoint_dir(path)
        checkpoint = _from_layout(path, optimizer=optimizer, weights_only=weights_only, averaged=averaged)
    return _mapped(checkpoint, map_location)


def _from_layout(path: Location, *, optimizer: bool, weights_only: bool | None, averaged: bool) -> dict[str, Any]:
    rest = _read_trainer_state(path / TRAINER_STATE, weights_only=weights_only)
    writer = rest.pop("lightscale", {})
    rest.pop("diloco", None)  # DiLoCo's worker bookkeeping; its global model is the state_dict
    described = writer.get("optimizers")
    checkpoint = {**rest, "state_dict": full_model_state_dict(path, prefix="")}
    average = full_model_state_dict(path, prefix="", part="averaged") if AVERAGED_META in rest and averaged else None
    checkpoint = to_lightning_convention(checkpoint, average)
    missing = _why_no_optimizer_state(path, writer)
    if optimizer and missing is None:
        checkpoint["optimizer_states"] = read_optimizer_states(path, described)
    elif optimizer:
        checkpoint["optimizer_states"] = []
    summary = {key: writer[key] for key in ("format", "strategy", "world_size") if key in writer}
    checkpoint["lightscale"] = {**summary, "consolidated": {"optimizers": described, "missing": missing}}
    return checkpoint


def _why_no_optimizer_state(path: Location, writer: dict[str, Any]) -> str | None:
    """None when the layout's optimizer state can be given in torch's format, else the reason it cannot."""
    strategy = writer.get("strategy", "an unknown writer")
    entries = safe_reader(path).read_metadata().state_dict_metadata
    if not any(key.startswith(_OPTIMIZER) for key in entries):
        return f"{path} (written by {strategy}) holds no optimizer state in the portable layout"
    if writer.get("optimizers") is None:
        return (
            f"{path} (written by {strategy}) does not record its optimizers' parameter groups (written before "
            "lightscale recorded them): its optimizer state cannot be numbered as torch's"
        )
    return None


def _read_trainer_state(file: Location, *, weights_only: bool | None) -> dict[str, Any]:
    hint = (
        "A plain class of yours in it (a config dataclass in the hyper-parameters) loads once registered with "
        "lightscale.checkpoint.allow_in_checkpoints(cls) in this process; else pass weights_only=False only if you "
        "trust the file."
    )
    return load_weights_only(file, hint=hint, trusted=weights_only is False)


def _from_deepspeed(path: Location) -> dict[str, Any]:
    """DeepSpeed's engine directory (a URL: downloaded to scratch once): full fp32 weights by ``zero_to_fp32`` and
    Lightning's client state."""
    with local_directory(path) as local:
        states = model_states_file(local)
        if states is None:
            raise ConfigurationError(
                f"{path / CHECKPOINT_TAG} holds no *model_states.pt file; it is not a ZeRO checkpoint."
            )
        saved = safe_load(states, map_location="cpu")
        weights = consolidate_zero_checkpoint(local, prefix="")
    rest = {key: value for key, value in saved.items() if key not in _DEEPSPEED_KEYS}
    missing = f"{path} is DeepSpeed's own directory (checkpoint_format='deepspeed'): its optimizer state is partitioned"
    return {
        **rest,
        "state_dict": weights,
        "optimizer_states": [],
        "lightscale": {"strategy": "ZeroStrategy", "consolidated": {"optimizers": None, "missing": missing}},
    }


def read_optimizer_states(path: Location, described: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch's ``Optimizer.state_dict()`` of each optimizer the writer recorded, from the name-keyed layout.

    One read of every ``optimizer.*`` entry (tensors full size, hyper-parameters weights-only)."""
    entries = safe_reader(path).read_metadata().state_dict_metadata
    template = {
        key[len(_OPTIMIZER) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else None
        for key, meta in entries.items()
        if key.startswith(_OPTIMIZER)
    }
    load_safely({"optimizer": template}, path, no_dist=True)
    return [_torch_optimizer_state(template, optimizer["groups"]) for optimizer in described]


def _entries_of(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``{key: value}`` of the entries ``prefix + key`` (keys without dots: parameter names may contain a prefix)."""
    return {
        key[len(prefix) :]: value
        for key, value in flat.items()
        if key.startswith(prefix) and "." not in key[len(prefix) :]
    }


def _torch_optimizer_state(flat: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for names in groups:
        settings = _entries_of(flat, f"param_groups.{names[0]}.") if names else {}
        param_groups.append({**settings, "params": list(range(index, index + len(names)))})
        for name in names:
            own = _entries_of(flat, f"state.{name}.")
            if own:
                state[index] = own
            index += 1
    return {"state": state, "param_groups": param_groups}


_TENSOR_ENTRIES = ("state_dict", "optimizer_states", "current_model_state")  # current_model_state: averaged.py


def _mapped(checkpoint: dict[str, Any], map_location: MapLocation) -> dict[str, Any]:
    """``map_location`` applied as ``torch.load`` would, to the tensors read from the shards (all on the CPU)."""
    if map_location is None:
        return checkpoint

    def move(value: Any) -> Any:
        if isinstance(value, Tensor):
            return _map_tensor(value, map_location)
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        if isinstance(value, list):
            return [move(item) for item in value]
        return value

    return {key: move(value) if key in _TENSOR_ENTRIES else value for key, value in checkpoint.items()}


def _map_tensor(tensor: Tensor, map_location: MapLocation) -> Tensor:
    if callable(map_location):  # torch.load's contract: (storage, location) -> storage or None
        storage = map_location(tensor.untyped_storage(), "cpu")
        if storage is None or storage.device == tensor.device:
            return tensor
        moved = torch.empty(0, dtype=tensor.dtype, device=storage.device)
        return moved.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    target = map_location.get("cpu", "cpu") if isinstance(map_location, dict) else map_location
    return tensor.to(target)


# ---- checking a run's optimizers against it ----------------------------------------------------------------------
def check_optimizers(checkpoint: dict[str, Any], module: nn.Module, optimizers: list[Optimizer]) -> None:
    """Refuse, naming what differs, to load the optimizer state of a converted lightscale checkpoint into
    ``optimizers`` unless they are the writer's: same count, classes and parameter names per group. Checkpoints
    not converted from a lightscale directory pass unchecked."""
    consolidated = checkpoint.get("lightscale", {}).get("consolidated")
    if consolidated is None or not optimizers:
        return
    if consolidated["missing"] is not None:
        raise ConfigurationError(
            f"{consolidated['missing']}, so fit(ckpt_path=...) cannot restore the optimizers here. Resume it under "
            "a lightscale strategy, or load only its weights (Model.load_from_checkpoint, or validate/test)."
        )
    live = _describe_local(module, optimizers)  # Lightning's own strategies hold whole parameters on every rank
    saved = consolidated["optimizers"]
    difference = _first_difference(saved, live)
    if difference is not None:
        raise ConfigurationError(
            f"The checkpoint's optimizer state does not fit this run's optimizers: {difference}. Return the "
            "optimizers it was trained with from configure_optimizers (same classes, parameter groups and order)."
        )


def _describe_local(module: nn.Module, optimizers: Iterable[Optimizer]) -> list[dict[str, Any]]:
    """This rank's part of :func:`describe_optimizers` (parameters outside ``module``: :data:`_UNKNOWN`)."""
    names = {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}
    return [
        {
            "class": type(o).__name__,
            "groups": [[names.get(id(p), _UNKNOWN) for p in g["params"]] for g in o.param_groups],
        }
        for o in optimizers
    ]


def _first_difference(saved: list[dict[str, Any]], live: list[dict[str, Any]]) -> str | None:
    if len(saved) != len(live):
        return f"{len(saved)} optimizer(s) in the checkpoint, {len(live)} in this run"
    for index, (old, new) in enumerate(zip(saved, live, strict=True)):
        if old["class"] != new["class"]:
            return f"optimizer {index} is {old['class']} in the checkpoint and {new['class']} in this run"
        if len(old["groups"]) != len(new["groups"]):
            counts = f"{len(old['groups'])} parameter groups in the checkpoint, {len(new['groups'])} here"
            return f"optimizer {index} has {counts}"
        for group, (before, now) in enumerate(zip(old["groups"], new["groups"], strict=True)):
            if before != now:
                only_saved = sorted(set(before) - set(now))[:3]
                only_live = sorted(set(now) - set(before))[:3]
                detail = (
                    f"only in the checkpoint {only_saved}, only here {only_live}"
                    if only_saved or only_live
                    else "another order"
                )
                return f"optimizer {index} group {group} holds other parameters ({detail})"
    return None
