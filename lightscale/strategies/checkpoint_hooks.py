"""Checkpoints in the one portable layout (lightscale/checkpoint/portable.py), for every lightscale strategy: saved by
any, loaded by any at any world size (DCP reshards), or as Lightning's single file (``checkpoint_format="file"``).

:class:`CheckpointingStrategy` sits between :class:`~lightscale.runtime.processes.ProcessStrategy` (ranks,
collectives) and :class:`~lightscale.strategies.base.LightscaleStrategy` (the model, the setup template, the step):
Lightning's checkpoint hooks (``save_checkpoint``, ``load_checkpoint``, ``load_model_state_dict``), the background
writer of ``async_save=True``, the multi-node shared-directory check, and what lightscale keeps beside Lightning's
state (every rank's random state, the data shards' loader positions, the exportable models). A strategy names the
module a rank holds (``checkpoint_module``) and overrides the rest only where an engine owns its state (ZeRO) or
the layout holds more (DiLoCo's workers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

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
from lightscale.runtime.processes import ProcessStrategy
from lightscale.storage.safe_io import SafeCheckpointIO
from lightscale.storage.shape_check import check_state_dict_shapes
from lightscale.storage.shared_dir import check_shared_dir
from lightscale.storage.urls import Location, check_shared, checkpoint_location
from lightscale.strategies.shards import TensorShards


class CheckpointingStrategy(TensorShards, ProcessStrategy):
    """Lightning's checkpoint hooks in the portable layout; ``async_save=True`` writes in the background (training
    blocks only while the state is copied to CPU memory; lightscale/checkpoint/async_save.py), on strategies that
    save through this class's ``save_checkpoint``. Other arguments: see ProcessStrategy."""

    # Whether a single-file Lightning checkpoint (whole tensors, optimizer state by index) loads: only into an
    # unsharded model; sharded strategies read the layout alone.
    reads_single_files: ClassVar[bool] = True
    # What ``checkpoint_format`` may name (the first is the default): "dcp" the portable layout, "file" Lightning's
    # single file (rank 0 writes it: whole parameters on every rank only), "deepspeed" DeepSpeed's own directory.
    checkpoint_formats: ClassVar[tuple[str, ...]] = ("dcp",)
    # Whether weights copied into the model after setup are the ones trained; False where an engine builds its own
    # fp32 master copies at setup (ZeRO). InitWeights (callbacks/init_weights.py) refuses strategies without it.
    weights_settable_after_setup: ClassVar[bool] = True

    def __init__(self, *, checkpoint_format: str = "dcp", async_save: bool = False, **kwargs: Any) -> None:
        self.checkpoint_format = checkpoint_format
        kwargs["checkpoint_io"] = kwargs.get("checkpoint_io") or SafeCheckpointIO()
        super().__init__(**kwargs)
        self._saved_rng_states: list[dict[str, Any]] | None = None  # from a checkpoint, set at the next batch
        self._shared_dirs: set[str] = set()
        self.checkpoint_writer = self._async_writer(async_save)

    def _async_writer(self, async_save: bool) -> AsyncCheckpointWriter | None:
        """The background writer of ``async_save=True`` (lightscale/checkpoint/async_save.py), or ``None``."""
        if not async_save:
            return None
        if self.checkpoint_format != "dcp":
            raise ConfigurationError(
                f"async_save=True writes the portable layout only; checkpoint_format={self.checkpoint_format!r} is "
                "written synchronously. Use checkpoint_format='dcp' with async_save, or async_save=False."
            )
        if not _saves_portable_layout(type(self)):
            # the strategies: subclasses of the layer on top of this one (LightscaleStrategy), not that layer itself
            strategies = [sub for layer in CheckpointingStrategy.__subclasses__() for sub in _subclasses(layer)]
            supported = sorted(cls.__name__ for cls in strategies if _saves_portable_layout(cls))
            raise ConfigurationError(
                f"async_save=True is not supported by {type(self).__name__}: it does not save through the portable "
                f"checkpoint writer. Strategies with async_save: {supported}."
            )
        return AsyncCheckpointWriter(timeout=self._timeout)

    def checkpoint_location(self, filepath: Any) -> Location:
        """Rank 0's ``filepath`` as a local path or an fsspec URL (lightscale/storage/urls.py): a URL whose filesystem
        is not installed, or that no other process can read (``memory://`` on several ranks), is refused."""
        location = checkpoint_location(self.broadcast(str(filepath)))
        check_shared(location, self.world_size)
        return location

    def check_checkpoint_locations(self, trainer: Any) -> None:
        """Before any rank starts: every ModelCheckpoint's ``dirpath`` as :meth:`checkpoint_location` takes it (a URL
        whose filesystem is missing, or ``memory://`` on several ranks, is refused now, not at the first save)."""
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None:
                check_shared(checkpoint_location(str(dirpath)), self.world_size)

    def check_checkpoint_dir(self, directory: str | Location) -> None:
        """Collective, once per directory: refuse a checkpoint directory that is not shared by every node (multi-node
        runs only; see lightscale/storage/shared_dir.py). Each rank probes the path it resolved itself: the same
        string naming different directories on different nodes is exactly the case to catch."""
        if self.num_nodes <= 1 or "://" in str(directory) or str(directory) in self._shared_dirs:
            return
        ranks = {"node_rank": self.node_rank, "local_rank": self.local_rank, "num_nodes": self.num_nodes}
        check_shared_dir(Path(directory), **ranks)
        self._shared_dirs.add(str(directory))

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the layout loads into the parallelized model and its optimizers, which setup creates

    @contextmanager
    def checkpoint_module(self) -> Iterator[nn.Module]:
        """The module whose state a checkpoint holds, under the LightningModule's own parameter names."""
        yield self.lightning_module

    # ---- save ----------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write ``filepath`` as a directory in the one layout every lightscale strategy reads: DCP shards of model
        and optimizer (keyed by parameter name) plus the rest of Lightning's checkpoint in ``trainer_state.pt``."""
        path = self.checkpoint_location(filepath)
        self.check_checkpoint_dir(path.parent)  # multi-node: refuse a directory not every node shares
        if self.checkpoint_format == "file":
            self.save_single_file(checkpoint, path)
            return
        with self.checkpoint_module() as module:
            rest = self.trainer_state(checkpoint)
            save_file = self.checkpoint_io.save_checkpoint
            averaged = checkpoint.get(AVERAGED)  # a WeightAveraging callback's (strategies/weight_averaging.py)
            writer = self.checkpoint_writer
            save_sharded(path, module, self.optimizers, rest, save_file, writer=writer, averaged=averaged)

    def save_single_file(self, checkpoint: dict[str, Any], path: Location) -> None:
        """``checkpoint_format="file"``: Lightning's own single file (its ``state_dict`` and ``optimizer_states``,
        whole tensors) plus the ``lightscale`` entry of :meth:`trainer_state` (random states, optimizer groups), which
        lets every strategy read it as the layout (checkpoint/portable_file.py). Rank 0 writes, atomically."""
        rest = self.trainer_state(checkpoint)  # collective
        if self.is_global_zero:
            # a WeightAveraging average as Lightning's own callback writes it (lightscale/checkpoint/averaged.py)
            single = to_lightning_convention({**checkpoint, "lightscale": rest["lightscale"]})
            self.checkpoint_io.save_checkpoint(single, path)
        self.barrier("save_single_file")

    def trainer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """Lightning's checkpoint without the tensors DCP writes, plus the ``lightscale`` entry naming the writer and
        holding every rank's random state, the optimizers' parameter groups and the exportable models (collective)."""
        optimizers = self.saved_optimizers()
        state = trainer_state_of(
            checkpoint, strategy=type(self).__name__, world_size=self.world_size, optimizers=optimizers
        )
        state["lightscale"][MODELS] = describe_models(self.lightning_module)  # what `lightscale export --hf` rebuilds
        return state

    def saved_optimizers(self) -> list[dict[str, Any]] | None:
        """Class and parameter names per group of each optimizer whose state the layout's ``optimizer.*`` entries
        hold (collective), so that Lightning's loaders can number it as torch does (checkpoint/lightning_format.py);
        None where the layout holds no such state."""
        with self.checkpoint_module() as module:
            return describe_optimizers(module, self.optimizers)

    # ---- load ----------------------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the layout saved by any lightscale strategy at any world size (DCP reshards); a single-file
        Lightning checkpoint (``.ckpt`` of earlier bucketed_ddp versions, one device) where ``reads_single_files``."""
        path = self.checkpoint_location(checkpoint_path)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if path.is_file() and self.reads_single_files:  # Lightning restores weights and optimizers by position
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
            self.restore_extras(checkpoint, fitting=fitting)
            return checkpoint
        with self.checkpoint_module() as module:
            read = load_sharded(path, module, self.optimizers if fitting else [])
        meta = self.read_trainer_state(read, fitting=fitting)
        return {**meta, "optimizer_states": []}  # loaded above; Lightning's optimizer restore then does nothing

    def read_trainer_state(self, checkpoint_dir: Location, *, fitting: bool) -> dict[str, Any]:
        """``trainer_state.pt`` of a layout directory (weights-only), or the rest of a single file; see
        :meth:`restore_extras`."""
        try:
            meta = read_rest(checkpoint_dir, self.checkpoint_io.load_checkpoint)
        finally:
            forget_file_layout()  # the last read of a load: a single file's kept copy goes now
        self.restore_extras(meta, fitting=fitting)
        return meta

    def restore_extras(self, meta: dict[str, Any], *, fitting: bool) -> None:
        """What lightscale keeps beside Lightning's state: when fitting, the random states are kept for the first
        batch (creating the data iterator after the load draws from torch's RNG) and the loader position of this
        rank's data shard replaces rank 0's."""
        if fitting:
            self._saved_rng_states = saved_rng_states(meta)
            take_own_loader_state(meta)  # rank 0 wrote the file: each data shard takes its own stream position back

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The first batch after a load draws from the saved random states (see :meth:`restore_extras`)."""
        states, self._saved_rng_states = self._saved_rng_states, None
        if states is not None:
            restore_rng_states(states)
        super().on_train_batch_start(batch, batch_idx)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """A single file (the layout was loaded in load_checkpoint); a differently shaped model's is refused naming
        the keys and shapes."""
        if "state_dict" in checkpoint:
            check_state_dict_shapes(
                checkpoint["state_dict"],
                self.lightning_module.state_dict(),
                "the checkpoint (ckpt_path)",
                shape_of=self.global_shape,
            )
            super().load_model_state_dict(checkpoint, strict=strict)


def _saves_portable_layout(cls: type) -> bool:
    """Whether ``cls`` saves through :meth:`CheckpointingStrategy.save_checkpoint` (what ``async_save`` runs in)."""
    return cls.save_checkpoint is CheckpointingStrategy.save_checkpoint


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]
