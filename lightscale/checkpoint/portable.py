"""The portable checkpoint layout every lightscale strategy writes and reads: one DCP directory per checkpoint.

Layout of ``CKPT/``::

    .metadata, __0_0.distcp, ...   model and optimizer state, each rank writing its own shards (DCP)
    trainer_state.pt               the rest of Lightning's checkpoint (loops, callbacks, LR schedulers,
                                   precision scaler, hyper-parameters), loadable with weights_only=True

DCP stores every tensor with its global shape and the offsets of each shard, so a checkpoint saved on N
ranks loads on M (resharding) and, offline, into one full state dict (:func:`full_model_state_dict`, which
``lightscale export``/``convert`` use: lightscale/checkpoint/convert.py).
Saves are atomic (lightscale/storage/atomic_dir.py): all ranks write into ``CKPT.tmp``, then rank 0 swaps it in,
so a run killed mid-save always leaves the previous or the new checkpoint complete.

Example:
    >>> save_sharded(path, model, optimizers, trainer_state_of(checkpoint, strategy="fsdp2", world_size=4), save)
    >>> load_sharded(path, model, optimizers)  # on any number of ranks
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from lightscale.checkpoint.async_save import AsyncCheckpointWriter
from lightscale.checkpoint.averaged import AVERAGED
from lightscale.checkpoint.portable_file import read_file_layout
from lightscale.checkpoint.rng import gather_rng_states
from lightscale.data.loader_position import gather_loader_states
from lightscale.errors import ConfigurationError
from lightscale.runtime.barrier import barrier
from lightscale.storage.atomic_dir import agreed_staging, complete_checkpoint, publish
from lightscale.storage.safe_dcp import load_safely, safe_reader
from lightscale.storage.shape_check import check_shapes, tensor_shapes
from lightscale.storage.urls import Location, refuse_incomplete, storage_writer

TRAINER_STATE = "trainer_state.pt"
# trainer_state["lightscale"] = {"format": LAYOUT_FORMAT, "strategy": ..., "world_size": ...}; loaders never need it.
LAYOUT_FORMAT = 1
_DCP_ENTRIES = ("state_dict", "optimizer_states", AVERAGED)  # the parts of Lightning's checkpoint DCP writes as shards
_MODEL = "model."  # DCP flattens {"model": {name: ...}} to "model.<name>"
# Optimizer state keyed by parameter name: ranks may hold different parameters (pipeline stages) and groups.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _barrier() -> None:
    if dist.is_initialized():
        barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def lightning_rest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Lightning's checkpoint without model and optimizer state (loops, callbacks, schedulers, hyper-parameters)."""
    return {key: value for key, value in checkpoint.items() if key not in _DCP_ENTRIES}


def trainer_state_of(
    checkpoint: dict[str, Any], *, strategy: str, world_size: int, optimizers: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``trainer_state.pt``'s content: :func:`lightning_rest` plus the ``lightscale`` entry naming the writer and
    holding every rank's random state and every data shard's loader position (collective: both are gathered) and,
    when given, the optimizers' classes and parameter names per group (lightning_format.py's ``describe_optimizers``:
    Lightning's loaders number the name-keyed optimizer state by it)."""
    writer: dict[str, Any] = {"format": LAYOUT_FORMAT, "strategy": strategy, "world_size": world_size}
    if optimizers is not None:
        writer["optimizers"] = optimizers
    loaders = gather_loader_states(checkpoint)  # collective, like the random states
    return {**lightning_rest(checkpoint), "lightscale": {**writer, "rng": gather_rng_states(), "loaders": loaders}}


def saved_rng_states(trainer_state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's random state from a ``trainer_state.pt`` (None when the writer stored none)."""
    return trainer_state.get("lightscale", {}).get("rng")


def save_sharded(
    path: Location,
    model: nn.Module,
    optimizers: list[Optimizer],
    trainer_state: dict[str, Any],
    save_file: Callable[[dict[str, Any], Path], None],
    *,
    writer: AsyncCheckpointWriter | None = None,
    averaged: dict[str, Tensor] | None = None,
) -> None:
    """Collectively save ``model``/``optimizers`` shards (and a weight average's, as ``averaged.*``) and (rank 0)
    ``trainer_state`` as directory ``path``."""
    model_state, optim_state = get_state_dict(model, optimizers, options=_FLAT)
    state = {"model": model_state, "optimizer": optim_state, **with_average(averaged)}
    write_checkpoint(path, state, trainer_state, save_file, writer=writer)


def with_average(averaged: dict[str, Tensor] | None) -> dict[str, Any]:
    """The ``averaged`` part of a checkpoint's DCP state, when a weight-averaging callback put one in."""
    return {"averaged": averaged} if averaged is not None else {}


def write_checkpoint(
    path: Location,
    state: dict[str, Any],
    trainer_state: dict[str, Any],
    save_file: Callable[[dict[str, Any], Path], None],
    *,
    writer: AsyncCheckpointWriter | None = None,
) -> None:
    """Collectively write ``state`` (``{"model": {fqn: tensor}, "optimizer": {...}}``, the layout of
    :func:`save_sharded`) with DCP and (rank 0) ``trainer_state``, published atomically as directory ``path``.

    The one writer of the format: any strategy that can express its state in this layout (DTensor shards, or
    whole tensors that DCP writes once) produces a checkpoint every other strategy loads. With ``writer`` (the
    strategy's ``async_save=True``) it returns once the state is staged in CPU memory and publishes in the
    background (lightscale/checkpoint/async_save.py).
    """
    if writer is not None:
        rest = copy.deepcopy(trainer_state) if _rank() == 0 else None  # training goes on mutating loop states
        writer.save(path, state, None if rest is None else lambda staging: save_file(rest, staging / TRAINER_STATE))
        return
    tmp = agreed_staging(path)
    dcp.save(state, storage_writer=storage_writer(tmp))
    if _rank() == 0:
        save_file(trainer_state, tmp / TRAINER_STATE)
    _barrier()
    if _rank() == 0:
        publish(tmp, path)
    _barrier()


def load_sharded(path: Location, model: nn.Module, optimizers: list[Optimizer]) -> Location:
    """Collectively load the shards of ``path`` into ``model`` (and ``optimizers``, if given), on any world size.

    Returns the directory read (``path``, or its previous copy after a crash mid-publish): its trainer state is
    ``returned / TRAINER_STATE``.
    """
    model_state, optim_state = get_state_dict(model, optimizers, options=_FLAT)
    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        state["optimizer"] = optim_state
    path = read_checkpoint(path, state)
    set_state_dict(
        model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}), options=_FLAT
    )
    return path


def load_model_part(path: Location, module: nn.Module) -> None:
    """Collectively fill ``module``'s weights (keys as its ``state_dict``) from the model part of ``path``."""
    state = get_model_state_dict(module)
    read_checkpoint(path, {"model": state})  # never runs code from the files; reshards
    set_model_state_dict(module, state)


def read_checkpoint(path: Location, state: dict[str, Any]) -> Location:
    """Collectively fill ``state`` (a template in :func:`write_checkpoint`'s layout: the tensors this rank wants,
    with their local shapes or DTensor placements) in place from ``path``; DCP reshards. Never runs code from
    the files. Returns the directory read (``path``, or its previous copy after a crash mid-publish)."""
    path = complete_checkpoint(path)
    if path.is_file():  # Lightning's single file (checkpoint_format="file"), read as the layout
        layout = read_file_layout(path)
        check_shapes(layout.model_shapes(), tensor_shapes(state.get("model", {})), str(path))
        layout.fill(state)
        return path
    check_checkpoint_dir(path)
    check_shapes(saved_model_shapes(path), tensor_shapes(state.get("model", {})), str(path))
    load_safely(state, path)
    return path


def layout_entries(path: Location) -> dict[str, Any]:
    """The layout's entries of checkpoint ``path`` (a directory's DCP metadata, read safely, or what a single file
    holds, layout_file.py): global shape and dtype of every tensor."""
    path = complete_checkpoint(path)
    if path.is_file():
        return read_file_layout(path).metadata()
    return safe_reader(path).read_metadata().state_dict_metadata


def read_rest(path: Location, load_file: Callable[[Location], dict[str, Any]]) -> dict[str, Any]:
    """Lightning's checkpoint without model and optimizer state: ``trainer_state.pt`` of a directory (read with
    ``load_file``), or the rest of a single file."""
    return read_file_layout(path).rest if path.is_file() else load_file(path / TRAINER_STATE)


def saved_model_shapes(path: Location) -> dict[str, tuple[int, ...]]:
    """Global shape of every model tensor in the checkpoint ``path``, from its (safely read) metadata."""
    entries = layout_entries(path)
    return {
        key[len(_MODEL) :]: tuple(meta.size)
        for key, meta in entries.items()
        if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)
    }


def check_checkpoint_dir(path: Location) -> None:
    refuse_incomplete(path)
    if not (path / ".metadata").is_file() or not (path / TRAINER_STATE).is_file():
        raise ConfigurationError(
            f"{path} is not a sharded checkpoint directory saved by a lightscale strategy (it needs .metadata "
            f"and {TRAINER_STATE}) or a Lightning checkpoint file."
        )


def full_model_state_dict(path: Location, *, prefix: str = "model.", part: str = "model") -> dict[str, Tensor]:
    """The full (unsharded) model tensors of the DCP checkpoint ``path`` whose keys start with ``prefix``;
    ``part="averaged"`` reads a weight-averaging callback's average instead of the raw weights.

    Only public DCP calls: the checkpoint's metadata gives every tensor's global shape and dtype; full-size
    tensors are allocated for the model's keys alone and ``dcp.load(no_dist=True)`` fills them from the shards.
    Unlike ``format_utils.dcp_to_torch_save``, this never reads the optimizer state (no memory for it) and never
    unpickles a non-tensor entry; ``.metadata`` is read by safe_dcp.py's restricted unpickler.
    """
    entries = safe_reader(path).read_metadata().state_dict_metadata
    top = part + "."
    wanted = {key[len(top) :]: meta for key, meta in entries.items() if key.startswith(top + prefix)}
    if not wanted and part == "averaged" and not any(key.startswith(top) for key in entries):
        raise ConfigurationError(
            f"{path} holds no averaged weights: it was saved without a WeightAveraging callback (see "
            "docs/callbacks/weight_averaging.md). Read the raw weights instead."
        )
    if not wanted:
        models = sorted(key[len(top) :] for key in entries if key.startswith(top))[:3]
        raise ConfigurationError(f"No {part} key of {path} starts with prefix {prefix!r}; keys look like {models}.")
    not_tensors = sorted(key for key, meta in wanted.items() if not isinstance(meta, TensorStorageMetadata))
    if not_tensors:
        raise ConfigurationError(
            f"{path} holds non-tensor model entries {not_tensors[:5]}; export writes tensors only (reading them "
            "would unpickle code). Pass a narrower prefix to leave them out."
        )
    full = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in wanted.items()}
    load_safely({part: full}, path, no_dist=True)
    return {name[len(prefix) :]: tensor for name, tensor in full.items()}
