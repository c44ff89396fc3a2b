"""DiLoCo's checkpoints (its ``checkpoint_writer``): what they read of the live run, the fp32 global model under the
module's names (the ``model.*`` entries), and whether a checkpoint resumes exactly at this layout or restarts every
worker from the global model; what :class:`DiLoCoWriter` saves and loads while the strategy trains (otherwise,
as any strategy's). The layout on disk is lightscale/strategies/diloco/saved_state.py's.

Example:
    >>> global_model(module, outer)  # {"net.0.weight": <the global copy>, ..., "net.1.running_mean": ...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule
from torch import nn
from typing_extensions import override

from lightscale.checkpoint.portable import write_checkpoint
from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.diloco import FaultTolerantOuterSync
from lightscale.parallel.diloco import OuterSync
from lightscale.parallel.mesh import ParallelDims
from lightscale.strategies.checkpointer import Checkpointer, PortableWriter
from lightscale.strategies.diloco.inner import InnerStrategy
from lightscale.strategies.diloco.saved_state import (
    diloco_state,
    like_param,
    load_diloco_state,
    load_global_state,
    read_diloco_state,
)
from lightscale.strategies.weight_averaging import drop_average


class DiLoCoRun(Protocol):
    """What :class:`DiLoCoWriter` reads of the strategy whose checkpoints it writes (``DiLoCoStrategy`` answers it):
    named here so that this module, which the strategy imports, does not import the strategy back."""

    outer: OuterSync | None  # None before and after training: the writer then writes as any strategy's
    ft: FaultTolerantOuterSync | None
    inner: InnerStrategy

    @property
    def dims(self) -> ParallelDims: ...

    @property
    def worker(self) -> int: ...

    @property
    def shard(self) -> int: ...

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]: ...

    @property
    def lightning_module(self) -> LightningModule | None: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...


def global_model(module: nn.Module, outer: OuterSync) -> dict[str, torch.Tensor]:
    """The module's whole ``state_dict`` with the parameters' fp32 global copies: a tied parameter under each of its
    names (a file without the second name misses a key in ``load_state_dict``), DTensors over the worker's shards
    when FSDP2 shards; the persistent buffers (the same on every rank) as they are, filled in place on load."""
    pairs = zip(outer.params, outer.named_globals(), strict=True)
    by_param = {id(param): like_param(param, tensor) for param, (_, tensor) in pairs}
    named = list(module.named_parameters(remove_duplicate=False))
    params = {name: by_param[id(param)] for name, param in named if id(param) in by_param}
    own = {name for name, _ in named}
    state = module.state_dict(keep_vars=True)
    buffers = {name: t for name, t in state.items() if name not in own and isinstance(t, torch.Tensor)}
    return {**params, **buffers}


def check_file_format(checkpoint_format: str, *, sharded: bool) -> None:
    """Refuse, at construction, ``checkpoint_format='file'`` when the inner strategy shards the global model."""
    if sharded and checkpoint_format == "file":
        raise ConfigurationError(
            "checkpoint_format='file' needs the global model whole on every rank; inner='fsdp2' shards it. Use "
            "inner='bucketed_ddp', or checkpoint_format='dcp' and `lightscale consolidate` for one file."
        )


def refuse_single_file(path: Path) -> None:
    """DiLoCo resumes from its portable layout only: a single file holds no worker's own state."""
    if path.is_file():
        raise ConfigurationError(
            f"{path} is a single file; DiLoCo resumes from its portable layout (checkpoint_format='dcp'), which "
            "holds every worker's own state. Evaluate the file, or start a new run from its weights (InitWeights)."
        )


def resumes_exactly(path: Path, saved: dict[str, Any] | None, *, workers: int, shards: int) -> bool:
    """Whether the checkpoint at ``path`` (its saved DiLoCo state) resumes exactly at ``workers`` x ``shards`` (else
    every worker restarts from the global model); refuses a checkpoint without DiLoCo state, and outer results in
    flight at another layout."""
    if saved is None:
        raise ConfigurationError(
            f"{path} was not saved by DiLoCo, so it holds no outer state to resume; load its model into a new run "
            f"with `lightscale export` (or train on with the strategy that saved it)."
        )
    same = (saved["workers"], saved.get("shards", 1)) == (workers, shards)
    if not same and saved["pending"]:
        raise ConfigurationError(
            f"{path} was saved with {len(saved['pending'])} outer result(s) in flight (overlap_steps > 0), which "
            f"only the saved layout ({saved['workers']} workers x {saved.get('shards', 1)} shards) can apply; "
            f"resume it with that layout, or at another number of workers from a checkpoint saved right after "
            f"a fragment's result landed."
        )
    return same


class DiLoCoWriter(PortableWriter):
    """While training (the outer loop running): the global model, every worker's own state and the outer state; before
    and after, the global model in the module as any strategy's checkpoint (the portable writer's)."""

    @override
    def saved_optimizers(self, checkpointer: Checkpointer) -> list[dict[str, Any]] | None:
        """None while training: each worker's inner state is its own (``diloco.*``), no ``optimizer.*`` entries."""
        return super().saved_optimizers(checkpointer) if _diloco(checkpointer).outer is None else None

    @override
    def save(self, checkpointer: Checkpointer, checkpoint: dict[str, Any], filepath: Any) -> None:
        drop_average(checkpoint, "DiLoCo's checkpoint keeps no weight average (each worker averages its own replica)")
        outer = _diloco(checkpointer).outer
        if outer is None:
            return super().save(checkpointer, checkpoint, filepath)
        path = checkpointer.location(filepath)  # a local path or an fsspec URL
        _save_training(checkpointer, outer, checkpoint, path)

    @override
    def load(self, checkpointer: Checkpointer, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Resume: at the saved workers and shards, exactly (globals, each worker's own state, the outer state); at
        others, every worker restarts from the global model with the outer state (a fresh inner optimizer). A
        checkpoint without DiLoCo state loads its model like any layout's (evaluation, another strategy's)."""
        path = checkpointer.location(checkpoint_path)
        outer = _diloco(checkpointer).outer
        if outer is None:
            return super().load(checkpointer, path, weights_only)
        return _load_training(checkpointer, outer, path)


DILOCO_WRITER = DiLoCoWriter()  # DiLoCoStrategy's ``checkpoint_writer``


def _diloco(checkpointer: Checkpointer) -> DiLoCoRun:
    """The DiLoCo strategy whose checkpoints ``checkpointer`` writes (this writer is that class's only)."""
    return checkpointer.strategy  # type: ignore[return-value]


def _save_training(checkpointer: Checkpointer, outer: OuterSync, checkpoint: dict[str, Any], path: Path) -> None:
    """A training run's checkpoint: the global model only as one file, else the portable layout with every worker's
    own state (``diloco.*``) and the outer state beside the global model (``model.*``)."""
    strategy = _diloco(checkpointer)
    checkpointer.check_dir(path.parent)
    if checkpointer.format == "file":  # the global model only: the workers' own state has no file form
        model = {name: tensor.detach() for name, tensor in global_model(strategy.lightning_module, outer).items()}
        rest = {key: value for key, value in checkpoint.items() if key != "optimizer_states"}
        checkpointer.save_single_file({**rest, "state_dict": model}, path)
        return
    tensors, meta = diloco_state(outer, strategy.optimizers[0], worker=strategy.worker, shard=strategy.shard)
    dims = strategy.dims
    meta |= {"workers": dims.dp_replicate, "shards": dims.dp_shard if strategy.inner.shards_parameters else 1}
    if strategy.ft is not None:
        meta["ft_rounds"] = strategy.ft.manager.current_step()
    rest = {**checkpointer.trainer_state(checkpoint), "diloco": meta}
    model = global_model(strategy.lightning_module, outer)
    write_checkpoint(path, {"model": model, "diloco": tensors}, rest, strategy.checkpoint_io.save_checkpoint)


def _load_training(checkpointer: Checkpointer, outer: OuterSync, path: Path) -> dict[str, Any]:
    """Resume a training run from ``path`` (see :meth:`DiLoCoWriter.load`); the trainer state it returns carries no
    optimizer states: each worker's inner state is loaded here, or starts afresh at another layout."""
    strategy = _diloco(checkpointer)
    refuse_single_file(path)
    meta = checkpointer.read_trainer_state(path, fitting=True)
    saved = meta.get("diloco")
    shards = strategy.dims.dp_shard if strategy.inner.shards_parameters else 1
    same = resumes_exactly(path, saved, workers=strategy.dims.dp_replicate, shards=shards)
    worker, shard = strategy.worker, strategy.shard
    model = global_model(strategy.lightning_module, outer)
    tensors = read_diloco_state(path, outer, model, worker=worker if same else None, shard=shard)
    if same:
        load_diloco_state(outer, strategy.optimizers[0], tensors, saved, worker=worker, shard=shard)
        if strategy.ft is not None:  # rounds committed: a worker behind its peers heals at its next round
            strategy.ft.manager.load_state_dict({"step": saved.get("ft_rounds", 0), "batches_committed": 0})
        return {**meta, "optimizer_states": []}
    load_global_state(outer, tensors, saved)
    return {**meta, "optimizer_states": []}  # the inner optimizer starts afresh from the global model
