"""The ZeRO strategy's checkpoints (its ``checkpointer_class``): DeepSpeed's engine owns the state, so it is saved as
the portable layout from the engine's fp32 masters and optimizer partitions (lightscale/zero/portable_save.py), or as
DeepSpeed's own directory (``checkpoint_format="deepspeed"``, lightscale/zero/checkpoint_dir.py), and loaded back
into the engine from either (lightscale/checkpoint/load_into_zero.py).

Example:
    >>> ZeroStrategy(stage=3).checkpointer  # a ZeroCheckpointer: trainer.save_checkpoint(path) writes the layout
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightscale.checkpoint.load_into_zero import load_zero_state_dict
from lightscale.checkpoint.portable import AVERAGED, lightning_rest, with_average, write_checkpoint
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.strategies.checkpointer import Checkpointer
from lightscale.strategies.weight_averaging import drop_average
from lightscale.zero.checkpoint_dir import CHECKPOINT_TAG, load_engine_directory, save_engine_directory
from lightscale.zero.portable_save import zero_optimizer, zero_state_dict

if TYPE_CHECKING:
    from lightscale.strategies.zero import ZeroStrategy


class ZeroCheckpointer(Checkpointer):
    """Checkpoints of DeepSpeed's engine, in the portable layout or DeepSpeed's own directory, atomically."""

    strategy: ZeroStrategy

    @override
    def save(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Save the portable layout (``checkpoint_format="dcp"``) or DeepSpeed's engine directory, atomically."""
        strategy = self.strategy
        target = self.location(filepath)  # a local path or an fsspec URL
        self.check_dir(target.parent)  # multi-node: refuse a directory not every node shares
        if self.format == "deepspeed":
            drop_average(checkpoint, "checkpoint_format='deepspeed' keeps no weight average")
            save_engine_directory(strategy.engine, target, lightning_rest(checkpoint))
            return
        rest = self.trainer_state(checkpoint)
        state = zero_state_dict(strategy.engine, strategy.lightning_module, strategy.group_names)
        state.update(with_average(checkpoint.get(AVERAGED)))
        write_checkpoint(target, state, rest, strategy.checkpoint_io.save_checkpoint)

    @override
    def saved_optimizers(self) -> list[dict[str, Any]] | None:
        """The user's optimizer (DeepSpeed's inner one) and its groups' names, recorded before DeepSpeed flattened
        them."""
        strategy = self.strategy
        zero = zero_optimizer(strategy.engine) if strategy.optimizers else None
        return [] if zero is None else [{"class": type(zero.optimizer).__name__, "groups": strategy.group_names}]

    @override
    def load(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume from either format, told apart by its files: DeepSpeed's directory has a tag sub-directory."""
        strategy = self.strategy
        fitting = strategy.lightning_module.trainer.state.fn == TrainerFn.FITTING
        path = complete_checkpoint(self.location(checkpoint_path))
        if (path / CHECKPOINT_TAG).is_dir():
            return load_engine_directory(strategy.engine, path, fitting=fitting)
        module, names = strategy.lightning_module, strategy.group_names
        read = load_zero_state_dict(path, strategy.engine, module, names, optimizer=fitting)
        return self.read_trainer_state(read, fitting=fitting)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded by the engine in load
