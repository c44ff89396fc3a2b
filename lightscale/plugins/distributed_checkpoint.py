"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): one directory per checkpoint.

Layout of ``CKPT/``::

    .metadata, __0_0.distcp, ...   model and optimizer state, each rank writing its own shards (DCP)
    trainer_state.pt               the rest of Lightning's checkpoint (loops, callbacks, LR schedulers,
                                   precision scaler, hyper-parameters), loadable with weights_only=True

DCP stores every tensor with its global shape and the offsets of each shard, so a checkpoint saved on N
ranks loads on M (resharding) and, offline, into one full state dict (:func:`export_full_state_dict`).
Saves are atomic: all ranks write into ``CKPT.tmp``, then rank 0 renames it, so a run killed mid-save
never leaves a half-written ``CKPT``.

Example:
    >>> export_full_state_dict("runs/last.ckpt", "gpt.pt")  # then GPT(config).load_state_dict(torch.load(...))
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from lightscale.errors import ConfigurationError

TRAINER_STATE = "trainer_state.pt"
# Optimizer state keyed by parameter name: ranks may hold different parameters (pipeline stages) and groups.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_sharded(
    path: Path,
    model: nn.Module,
    optimizers: list[Optimizer],
    trainer_state: dict[str, Any],
    save_file: Callable[[dict[str, Any], Path], None],
    *,
    trainer_state_name: str = TRAINER_STATE,
) -> None:
    """Collectively save ``model``/``optimizers`` shards and (rank 0) ``trainer_state`` as directory ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    if _rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizers, options=_FLAT)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    if _rank() == 0:
        save_file(trainer_state, tmp / trainer_state_name)
    _barrier()
    if _rank() == 0:
        _replace(tmp, path)
    _barrier()


def _replace(new: Path, target: Path) -> None:
    old = target.with_name(target.name + ".old")
    if target.is_dir():
        target.rename(old)
    elif target.exists():
        target.unlink()
    new.rename(target)
    if old.exists():
        shutil.rmtree(old)


def load_sharded(
    path: Path, model: nn.Module, optimizers: list[Optimizer], *, trainer_state_name: str = TRAINER_STATE
) -> None:
    """Collectively load the shards of ``path`` into ``model`` (and ``optimizers``, if given), on any world size."""
    check_checkpoint_dir(path, trainer_state_name)
    model_state, optim_state = get_state_dict(model, optimizers, options=_FLAT)
    state: dict[str, Any] = {"model": model_state}
    if optimizers:
        state["optimizer"] = optim_state
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {}), options=_FLAT
    )


def check_checkpoint_dir(path: Path, trainer_state_name: str = TRAINER_STATE) -> None:
    if not (path / ".metadata").is_file() or not (path / trainer_state_name).is_file():
        raise ConfigurationError(
            f"{path} is not a sharded checkpoint directory saved by an FSDP2 strategy or parallel_3d (it "
            f"needs .metadata and {trainer_state_name}). Single-file checkpoints of other strategies cannot be "
            "resumed here."
        )


def export_full_state_dict(checkpoint_dir: str | Path, output: str | Path, *, prefix: str = "model.") -> list[str]:
    """Consolidate a sharded checkpoint's model into one ``torch.save`` file loadable by the single-device model.

    Runs in one process, no process group. Keys starting with ``prefix`` (the LightningModule attribute that
    holds the model) are kept with the prefix removed; ``prefix=""`` keeps every key. Returns the keys written.
    """
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(checkpoint_dir)
    check_checkpoint_dir(path)
    full: dict[str, Any] = {}
    reader = dcp.FileSystemReader(str(path))
    _load_state_dict(full, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    model = {k[len(prefix) :]: v for k, v in full["model"].items() if k.startswith(prefix)}
    if not model:
        raise ConfigurationError(
            f"No model key of {path} starts with prefix {prefix!r}; keys look like {sorted(full['model'])[:3]}."
        )
    torch.save(model, output)
    return sorted(model)
