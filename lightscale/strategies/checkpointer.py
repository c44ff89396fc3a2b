"""The checkpoint IO a lightscale strategy owns (``strategy.checkpointer``), as a Lightning strategy owns its
``CheckpointIO``: checkpoints in the one portable layout (lightscale/checkpoint/portable.py), saved by any strategy
and loaded by any at any world size (DCP reshards), or as Lightning's single file (``checkpoint_format="file"``).

The strategy keeps Lightning's entry points (``save_checkpoint``, ``load_checkpoint``, ``load_model_state_dict``) and
hands them to its :class:`Checkpointer`, built from ``checkpoint_format`` and ``async_save``. What lightscale keeps
beside Lightning's state is here too: every rank's random state, the data shards' loader positions, the exportable
models, the multi-node shared-directory check and the background writer of ``async_save=True``.

There is one Checkpointer; a family does not subclass it but hands over what differs, as its strategy answers:
``checkpoint_states()``, its own state as named ``Stateful`` objects saved in the ``lightscale`` entry and given back
on resume (torchft's count, PowerSGD's residuals); ``checkpoint_module()``, the module a rank's checkpoint holds
(parallel_3d: its stages, under the whole model's names); and ``checkpoint_writer``, the one object that writes and
reads its checkpoints where writing itself differs (ZeRO's engine partitions, DiLoCo's workers; default
:data:`PORTABLE`, the portable layout, the only writer ``async_save`` runs in).

Example:
    >>> class MyStrategy(LightscaleStrategy):
    ...     def checkpoint_states(self) -> dict[str, Stateful]:
    ...         return {**super().checkpoint_states(), "my_counter": self.counter}  # saved as lightscale.my_counter
    ...     def checkpoint_module(self) -> nn.Module:
    ...         return self.pipelined.checkpoint_view  # what this rank trains, under the whole model's names
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from lightscale.checkpoint.async_save import AsyncCheckpointWriter
from lightscale.checkpoint.averaged import to_lightning_convention
from lightscale.checkpoint.hf_export import MODELS, describe_models
from lightscale.checkpoint.lightning_format import describe_optimizers
from lightscale.checkpoint.portable import (
    AVERAGED,
    load_sharded,
    read_rest,
    save_sharded,
    saved_rng_states,
    trainer_state_of,
)
from lightscale.checkpoint.portable_file import forget_file_layout
from lightscale.checkpoint.rng import restore_rng_states
from lightscale.data.loader_position import take_own_loader_state
from lightscale.errors import ConfigurationError
from lightscale.storage.shape_check import check_state_dict_shapes
from lightscale.storage.shared_dir import check_shared_dir
from lightscale.storage.urls import Location, check_shared, checkpoint_location
from lightscale.strategies.registry import REGISTERED
from lightscale.strategies.shards import TensorShards


class CheckpointedStrategy(Protocol):
    """What the checkpointer asks of the strategy it serves (``LightscaleStrategy`` answers all of it): ranks and
    collectives, Lightning's module, optimizers and file IO, and the family's hand-over (``checkpoint_states``,
    ``checkpoint_module``, ``checkpoint_writer``). Taking this, not the base class, keeps the base -> checkpointer
    import one way."""

    checkpoint_writer: ClassVar[PortableWriter]
    reads_single_files: ClassVar[bool]
    tensor_shards: ClassVar[TensorShards]
    timeout: timedelta
    checkpoint_io: CheckpointIO
    optimizers: list[Any]

    @property
    def lightning_module(self) -> LightningModule: ...
    @property
    def world_size(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    def broadcast(self, obj: Any, src: int = 0) -> Any: ...
    def barrier(self, *args: Any, **kwargs: Any) -> None: ...
    def checkpoint_states(self) -> dict[str, Stateful]: ...
    def checkpoint_module(self) -> nn.Module: ...


class Checkpointer:
    """Lightning's checkpoint hooks in the portable layout for ``strategy``; ``async_save=True`` writes in the
    background (training blocks only while the state is copied to CPU memory; lightscale/checkpoint/async_save.py),
    for strategies whose checkpointer saves through :meth:`save`."""

    def __init__(self, strategy: CheckpointedStrategy, *, checkpoint_format: str, async_save: bool) -> None:
        self.strategy = strategy
        self.format = checkpoint_format
        self._saved_rng_states: list[dict[str, Any]] | None = None  # from a checkpoint, set at the next batch
        self._shared_dirs: set[str] = set()
        self.writer = self._async_writer(async_save)

    def _async_writer(self, async_save: bool) -> AsyncCheckpointWriter | None:
        """The background writer of ``async_save=True`` (lightscale/checkpoint/async_save.py), or ``None``."""
        if not async_save:
            return None
        if self.format != "dcp":
            raise ConfigurationError(
                f"async_save=True writes the portable layout only; checkpoint_format={self.format!r} is "
                "written synchronously. Use checkpoint_format='dcp' with async_save, or async_save=False."
            )
        if not _saves_portable_layout(type(self.strategy)):
            supported = sorted(cls.__name__ for cls in REGISTERED if _saves_portable_layout(cls))
            raise ConfigurationError(
                f"async_save=True is not supported by {type(self.strategy).__name__}: it does not save through the "
                f"portable checkpoint writer. Strategies with async_save: {supported}."
            )
        overriding = _overrides_save_checkpoint(type(self.strategy))
        if overriding is not None:
            raise ConfigurationError(
                f"async_save=True is not supported with {overriding}.save_checkpoint: it overrides the strategy's "
                "hand-over to its Checkpointer, whose background writer would publish the checkpoint without (or over) "
                "what the override writes. Hand what it writes to the Checkpointer as named Stateful objects (the "
                "strategy's `checkpoint_states`) instead, or use async_save=False."
            )
        return AsyncCheckpointWriter(timeout=self.strategy.timeout)

    def wait(self) -> None:
        """The last background save is published (teardown: before fit returns)."""
        if self.writer is not None:
            self.writer.wait()

    # ---- where checkpoints go --------------------------------------------------------------------------------
    def location(self, filepath: Any) -> Location:
        """Rank 0's ``filepath`` as a local path or an fsspec URL (lightscale/storage/urls.py): a URL whose filesystem
        is not installed, or that no other process can read (``memory://`` on several ranks), is refused."""
        location = checkpoint_location(self.strategy.broadcast(str(filepath)))
        check_shared(location, self.strategy.world_size)
        return location

    def check_locations(self, trainer: Any) -> None:
        """Before any rank starts: every ModelCheckpoint's ``dirpath`` as :meth:`location` takes it (a URL whose
        filesystem is missing, or ``memory://`` on several ranks, is refused now, not at the first save)."""
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None:
                check_shared(checkpoint_location(str(dirpath)), self.strategy.world_size)

    def check_dir(self, directory: str | Location) -> None:
        """Collective, once per directory: refuse a checkpoint directory that is not shared by every node (multi-node
        runs only; see lightscale/storage/shared_dir.py). Each rank probes the path it resolved itself: the same
        string naming different directories on different nodes is exactly the case to catch."""
        strategy = self.strategy
        if strategy.num_nodes <= 1 or "://" in str(directory) or str(directory) in self._shared_dirs:
            return
        ranks = {"node_rank": strategy.node_rank, "local_rank": strategy.local_rank, "num_nodes": strategy.num_nodes}
        check_shared_dir(Path(directory), **ranks)
        self._shared_dirs.add(str(directory))

    def check_callback_dirs(self, trainer: Any) -> None:
        """At setup: :meth:`check_dir` for every ModelCheckpoint whose ``dirpath`` is given (else it is resolved later,
        and checked at the first save)."""
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "dirpath", None):
                self.check_dir(callback.dirpath)

    @contextmanager
    def module(self) -> Iterator[nn.Module]:
        """The module whose state a checkpoint holds, under the LightningModule's own parameter names: what the
        strategy's ``checkpoint_module()`` answers (parallel_3d: this rank's stages)."""
        yield self.strategy.checkpoint_module()

    @property
    def layout_writer(self) -> PortableWriter:
        """The object that writes and reads the strategy's checkpoints: its class's ``checkpoint_writer``."""
        return type(self.strategy).checkpoint_writer

    # ---- save ------------------------------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Write ``filepath`` as the strategy's ``checkpoint_writer`` does (by default the portable layout)."""
        self.layout_writer.save(self, checkpoint, filepath)

    def save_single_file(self, checkpoint: dict[str, Any], path: Location) -> None:
        """``checkpoint_format="file"``: Lightning's own single file (its ``state_dict`` and ``optimizer_states``,
        whole tensors) plus the ``lightscale`` entry of :meth:`trainer_state` (random states, optimizer groups), which
        lets every strategy read it as the layout (checkpoint/portable_file.py). Rank 0 writes, atomically."""
        rest = self.trainer_state(checkpoint)  # collective
        if self.strategy.is_global_zero:
            # a WeightAveraging average as Lightning's own callback writes it (lightscale/checkpoint/averaged.py)
            single = to_lightning_convention({**checkpoint, "lightscale": rest["lightscale"]})
            self.strategy.checkpoint_io.save_checkpoint(single, path)
        self.strategy.barrier("save_single_file")

    def trainer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Lightning's checkpoint without the tensors DCP writes, plus the ``lightscale`` entry naming the writer and
        holding every rank's random state, the optimizers' parameter groups and the exportable models (collective)."""
        strategy = self.strategy
        optimizers = self.saved_optimizers()
        name, world_size = type(strategy).__name__, strategy.world_size
        state = trainer_state_of(checkpoint, strategy=name, world_size=world_size, optimizers=optimizers)
        state["lightscale"][MODELS] = describe_models(strategy.lightning_module)  # what `lightscale export --hf` builds
        for key, stateful in strategy.checkpoint_states().items():  # the family's own state, handed over by name
            state["lightscale"][key] = stateful.state_dict()
        return state

    def saved_optimizers(self) -> list[dict[str, Any]] | None:
        """Class and parameter names per group of each optimizer whose state the layout's ``optimizer.*`` entries
        hold (collective), as the strategy's ``checkpoint_writer`` records them; None where it holds no such state."""
        return self.layout_writer.saved_optimizers(self)

    # ---- load ------------------------------------------------------------------------------------------------
    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``checkpoint_path`` as the strategy's ``checkpoint_writer`` reads it (by default the portable layout
        saved by any lightscale strategy at any world size, or a single file)."""
        return self.layout_writer.load(self, checkpoint_path, weights_only)

    def read_trainer_state(self, checkpoint_dir: Location, *, fitting: bool) -> dict[str, Any]:
        """``trainer_state.pt`` of a layout directory (weights-only), or the rest of a single file; see
        :meth:`restore_extras`."""
        try:
            meta = read_rest(checkpoint_dir, self.strategy.checkpoint_io.load_checkpoint)
        finally:
            forget_file_layout()  # the last read of a load: a single file's kept copy goes now
        self.restore_extras(meta, fitting=fitting)
        return meta

    def restore_extras(self, meta: dict[str, Any], *, fitting: bool) -> None:
        """What lightscale keeps beside Lightning's state: when fitting, the random states are kept for the first
        batch (creating the data iterator after the load draws from torch's RNG; :meth:`restore_random_states`) and
        the loader position of this rank's data shard replaces rank 0's."""
        if fitting:
            self._saved_rng_states = saved_rng_states(meta)
            take_own_loader_state(meta)  # rank 0 wrote the file: each data shard takes its own stream position back
            saved = meta.get("lightscale", {})
            for key, stateful in self.strategy.checkpoint_states().items():
                if saved.get(key) is not None:  # a checkpoint written without it leaves the object's fresh state
                    stateful.load_state_dict(saved[key])

    def restore_random_states(self) -> None:
        """At the first batch after a load: every rank's random states as saved (see :meth:`restore_extras`)."""
        states, self._saved_rng_states = self._saved_rng_states, None
        if states is not None:
            restore_rng_states(states)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A single file's model state, as the strategy's ``checkpoint_writer`` loads it (the layout was loaded in
        :meth:`load`)."""
        self.layout_writer.load_model_state_dict(self, checkpoint, strict)


class PortableWriter:
    """How the portable layout is written and read (every strategy's ``checkpoint_writer`` unless its family's state
    is written otherwise, as ZeRO's engine or DiLoCo's workers): one stateless object per class; each method is given
    the strategy's :class:`Checkpointer` (where checkpoints go, ``trainer_state.pt``, the background writer)."""

    def save(self, checkpointer: Checkpointer, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Write ``filepath`` as a directory in the one layout every lightscale strategy reads: DCP shards of model
        and optimizer (keyed by parameter name) plus the rest of Lightning's checkpoint in ``trainer_state.pt``."""
        strategy = checkpointer.strategy
        path = checkpointer.location(filepath)
        checkpointer.check_dir(path.parent)  # multi-node: refuse a directory not every node shares
        if checkpointer.format == "file":
            checkpointer.save_single_file(checkpoint, path)
            return
        with checkpointer.module() as module:
            rest = checkpointer.trainer_state(checkpoint)
            save_file = strategy.checkpoint_io.save_checkpoint
            averaged = checkpoint.get(AVERAGED)  # a WeightAveraging callback's (strategies/weight_averaging.py)
            writer = checkpointer.writer
            save_sharded(path, module, strategy.optimizers, rest, save_file, writer=writer, averaged=averaged)

    def saved_optimizers(self, checkpointer: Checkpointer) -> list[dict[str, Any]] | None:
        """Class and parameter names per group of each optimizer whose state the layout's ``optimizer.*`` entries
        hold (collective), so that Lightning's loaders can number it as torch does (checkpoint/lightning_format.py)."""
        with checkpointer.module() as module:
            return describe_optimizers(module, checkpointer.strategy.optimizers)

    def load(self, checkpointer: Checkpointer, checkpoint_path: Any, weights_only: bool | None) -> dict[str, Any]:
        """Load the layout saved by any lightscale strategy at any world size (DCP reshards); a single-file
        Lightning checkpoint (``.ckpt`` of earlier bucketed_ddp versions, one device) where the strategy's
        ``reads_single_files``."""
        strategy = checkpointer.strategy
        path = checkpointer.location(checkpoint_path)
        fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if path.is_file() and strategy.reads_single_files:  # Lightning restores weights and optimizers by position
            torch.cuda.empty_cache()  # as Lightning's Strategy.load_checkpoint
            checkpoint = strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            checkpointer.restore_extras(checkpoint, fitting=fitting)
            return checkpoint
        with checkpointer.module() as module:
            read = load_sharded(path, module, strategy.optimizers if fitting else [])
        meta = checkpointer.read_trainer_state(read, fitting=fitting)
        return {**meta, "optimizer_states": []}  # loaded above; Lightning's optimizer restore then does nothing

    def load_model_state_dict(self, checkpointer: Checkpointer, checkpoint: Any, strict: bool) -> None:
        """A single file (the layout was loaded in :meth:`load`); a differently shaped model's is refused naming the
        keys and shapes."""
        if "state_dict" in checkpoint:
            strategy = checkpointer.strategy
            module = strategy.lightning_module
            shape_of = strategy.tensor_shards.global_shape
            check_state_dict_shapes(
                checkpoint["state_dict"], module.state_dict(), "the checkpoint (ckpt_path)", shape_of=shape_of
            )
            module.load_state_dict(checkpoint["state_dict"], strict=strict)  # as Lightning's Strategy does


PORTABLE = PortableWriter()  # the default ``checkpoint_writer``


def _saves_portable_layout(cls: type[Any]) -> bool:
    """Whether ``cls``'s ``checkpoint_writer`` saves through :meth:`PortableWriter.save` (what ``async_save`` runs
    in)."""
    return type(cls.checkpoint_writer).save is PortableWriter.save


def _overrides_save_checkpoint(cls: type[Any]) -> str | None:
    """The class that replaces the base's one-line ``save_checkpoint`` (lightscale/strategies/base.py), or ``None``."""
    owner = next(klass for klass in cls.__mro__ if "save_checkpoint" in klass.__dict__)
    is_base = owner.__module__ == "lightscale.strategies.base" and owner.__name__ == "LightscaleStrategy"
    return None if is_base else owner.__name__
