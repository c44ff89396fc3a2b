"""The ZeRO strategy's checkpoints (its ``checkpoint_writer``): DeepSpeed's engine owns the state, so it is saved as
the portable layout from the engine's fp32 masters and optimizer partitions (deepspeed/portable_save.py), or as
DeepSpeed's own directory (``checkpoint_format="deepspeed"``, lightscale/checkpoint/deepspeed_dir.py), and loaded back
into the engine from either (lightscale/strategies/deepspeed/load_portable.py).

Example:
    >>> ZeroStrategy.checkpoint_writer  # ZERO_WRITER: trainer.save_checkpoint(path) writes the layout from the engine
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightscale.checkpoint.deepspeed_dir import CHECKPOINT_TAG, saved_parameter_shapes
from lightscale.checkpoint.portable import AVERAGED, lightning_rest, with_average, write_checkpoint
from lightscale.errors import ConfigurationError
from lightscale.patches.deepspeed import skip_bit16_refresh
from lightscale.runtime.barrier import barrier
from lightscale.storage.atomic_dir import agreed_staging, complete_checkpoint, publish
from lightscale.storage.shape_check import check_shapes
from lightscale.storage.staged_copy import local_directory, scratch_directory, upload_directory
from lightscale.storage.urls import Location, RemotePath
from lightscale.strategies.checkpointer import CheckpointedStrategy, Checkpointer, PortableWriter
from lightscale.strategies.deepspeed.load_portable import load_zero_state_dict
from lightscale.strategies.deepspeed.partition import whole_shape
from lightscale.strategies.deepspeed.portable_save import zero_optimizer, zero_state_dict
from lightscale.strategies.weight_averaging import drop_average


class ZeroCheckpointed(CheckpointedStrategy, Protocol):
    """What this writer asks of ZeroStrategy beyond any strategy's hand-over: DeepSpeed's engine and the names of
    the optimizer's groups recorded before DeepSpeed flattened them. The strategy imports this writer, not the
    other way."""

    group_names: list[list[str]]

    @property
    def engine(self) -> Any: ...


class ZeroWriter(PortableWriter):
    """Checkpoints of DeepSpeed's engine, in the portable layout or DeepSpeed's own directory, atomically."""

    @override
    def save(self, checkpointer: Checkpointer, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Save the portable layout (``checkpoint_format="dcp"``) or DeepSpeed's engine directory, atomically."""
        strategy = _zero(checkpointer)
        target = checkpointer.location(filepath)  # a local path or an fsspec URL
        checkpointer.check_dir(target.parent)  # multi-node: refuse a directory not every node shares
        if checkpointer.format == "deepspeed":
            drop_average(checkpoint, "checkpoint_format='deepspeed' keeps no weight average")
            save_engine_directory(strategy.engine, target, lightning_rest(checkpoint))
            return
        rest = checkpointer.trainer_state(checkpoint)
        state = zero_state_dict(strategy.engine, strategy.lightning_module, strategy.group_names)
        state.update(with_average(checkpoint.get(AVERAGED)))
        write_checkpoint(target, state, rest, strategy.checkpoint_io.save_checkpoint)

    @override
    def saved_optimizers(self, checkpointer: Checkpointer) -> list[dict[str, Any]] | None:
        """The user's optimizer (DeepSpeed's inner one) and its groups' names, recorded before DeepSpeed flattened
        them."""
        strategy = _zero(checkpointer)
        zero = zero_optimizer(strategy.engine) if strategy.optimizers else None
        return [] if zero is None else [{"class": type(zero.optimizer).__name__, "groups": strategy.group_names}]

    @override
    def load(self, checkpointer: Checkpointer, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Resume from either format, told apart by its files: DeepSpeed's directory has a tag sub-directory."""
        strategy = _zero(checkpointer)
        fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path = complete_checkpoint(checkpointer.location(checkpoint_path))
        if (path / CHECKPOINT_TAG).is_dir():
            return load_engine_directory(strategy.engine, path, fitting=fitting)
        module, names = strategy.lightning_module, strategy.group_names
        read = load_zero_state_dict(path, strategy.engine, module, names, optimizer=fitting)
        return checkpointer.read_trainer_state(read, fitting=fitting)

    @override
    def load_model_state_dict(self, checkpointer: Checkpointer, checkpoint: Any, strict: bool) -> None:
        pass  # loaded by the engine in load


ZERO_WRITER = ZeroWriter()  # ZeroStrategy's ``checkpoint_writer``


def _zero(checkpointer: Checkpointer) -> ZeroCheckpointed:
    """The ZeRO strategy whose checkpoints ``checkpointer`` writes (this writer is that class's only)."""
    return checkpointer.strategy  # type: ignore[return-value]


# ---- DeepSpeed's own directory, written and read by the engine (checkpoint/deepspeed_dir.py reads it offline) ----
_RANK_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_|(?:^|/)offloaded_tensors/rank(\d+)/")


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_engine_directory(engine: Any, target: Location, client_state: dict[str, Any]) -> None:
    """Collectively save ``engine`` as DeepSpeed's directory ``target``: written beside it, then swapped in (a URL:
    each rank's files uploaded from local scratch, then the completion marker)."""
    staging = agreed_staging(target)  # rank 0 cleared it before anyone writes
    if isinstance(staging, RemotePath):
        with scratch_directory() as local:
            engine.save_checkpoint(str(local), client_state=client_state, tag=CHECKPOINT_TAG)
            upload_directory(local, staging)  # this rank's files only: DeepSpeed names them by rank
    else:
        engine.save_checkpoint(str(staging), client_state=client_state, tag=CHECKPOINT_TAG)
    barrier()
    if _is_rank_zero():
        publish(staging, target)
    barrier()


def load_engine_directory(engine: Any, path: Location, *, fitting: bool) -> dict[str, Any]:
    """Collectively load DeepSpeed's directory ``path`` (local, or a complete one at a URL) into ``engine``
    (optimizer state when ``fitting``); returns the client state saved with it (the rest of Lightning's
    checkpoint)."""
    optimizer = engine.optimizer
    if not fitting:  # ZeRO-3 evaluation's optimizer stand-in has no fp32 master to refresh; DeepSpeed refreshes anyway
        skip_bit16_refresh(optimizer)
    model = {name: tuple(whole_shape(p)) for name, p in engine.module.named_parameters()}
    # data-parallel rank = global rank: lightscale's ZeRO spans the whole world
    keep = read_by_rank(dist.get_rank() if dist.is_initialized() else 0, elastic=engine.zero_elastic_checkpoint())
    with local_directory(path, keep=keep) as local:
        check_shapes(saved_parameter_shapes(local), model, str(path))  # before DeepSpeed reads any shard
        _, client_state = engine.load_checkpoint(
            str(local), tag=CHECKPOINT_TAG, load_optimizer_states=fitting, load_lr_scheduler_states=False
        )
    if client_state is None:
        raise ConfigurationError(f"{path} is not a checkpoint directory saved by a ZeRO strategy.")
    return client_state


def read_by_rank(rank: int, *, elastic: bool) -> Callable[[str], bool]:
    """Which files of a checkpoint (relative names) data-parallel ``rank``'s engine reads: all but other ranks'
    partitions; all of them with DeepSpeed's elastic checkpoints (``zero_optimization.elastic_checkpoint``)."""

    def keep(name: str) -> bool:
        match = _RANK_FILE.search(name)
        return elastic or match is None or int(match.group(1) or match.group(2)) == rank

    return keep
