"""A strategy owns its checkpoint IO (``strategy.checkpointer``, lightscale/strategies/checkpointer.py): a family whose
checkpoints differ names a Checkpointer subclass, and a strategy written for the former checkpoint base class (methods
such as ``trainer_state`` on the strategy) is refused when the class is defined, not silently never called."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightscale.errors import ConfigurationError
from lightscale.strategies import BucketedDDPStrategy, Checkpointer, DiLoCoStrategy, FSDP2Strategy, ZeroStrategy


class TaggedCheckpointer(Checkpointer):
    """A user's checkpointer: one more entry beside Lightning's state."""

    def trainer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        state = super().trainer_state(checkpoint)
        state["lightscale"]["tag"] = "mine"
        return state


class TaggedDDP(BucketedDDPStrategy):  # no aliases: not registered
    checkpointer_class = TaggedCheckpointer


def test_every_strategy_owns_a_checkpointer_built_from_its_settings() -> None:
    strategy = TaggedDDP(checkpoint_format="file")
    assert type(strategy.checkpointer) is TaggedCheckpointer and strategy.checkpointer.strategy is strategy
    assert strategy.checkpointer.format == "file" and strategy.checkpointer.writer is None
    fsdp2 = FSDP2Strategy(async_save=True)
    assert type(fsdp2.checkpointer).__name__ == "Checkpointer" and fsdp2.checkpointer.writer is not None
    assert type(ZeroStrategy(stage=2).checkpointer).__name__ == "ZeroCheckpointer"


def test_async_save_is_refused_where_the_checkpointer_does_not_save_the_layout() -> None:
    with pytest.raises(ConfigurationError, match=r"async_save=True is not supported by DiLoCoStrategy.*FSDP2Strategy"):
        DiLoCoStrategy(workers=2, async_save=True)


class SidecarDDP(BucketedDDPStrategy):  # a user's strategy that writes a file beside Lightning's checkpoint
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        (Path(filepath) / "sidecar.txt").write_text("mine")


def test_async_save_is_refused_where_the_strategy_overrides_save_checkpoint() -> None:
    # The background writer publishes the directory after the override wrote its sidecar into it: async_save cannot
    # honour it, so it is refused before work starts, naming the override and where saving code goes.
    with pytest.raises(ConfigurationError, match=r"async_save=True is not supported with SidecarDDP\.save_checkpoint.*"
                       r"`save` on a Checkpointer subclass.*checkpointer_class.*async_save=False"):  # fmt: skip
        SidecarDDP(async_save=True)
    assert SidecarDDP().checkpointer.writer is None  # synchronous saving is the user's own
    assert TaggedDDP(async_save=True).checkpointer.writer is not None  # a Checkpointer subclass keeps async_save


class Extras:
    """A mixin written for the former base class: its hook would never be called."""

    def restore_extras(self, meta: dict[str, Any], *, fitting: bool) -> None:
        pass


def test_a_checkpoint_method_on_the_strategy_is_refused_naming_the_checkpointer() -> None:
    with pytest.raises(TypeError, match=r"OldStyle defines \['restore_extras', 'trainer_state'\].*checkpointer_class"):

        class OldStyle(BucketedDDPStrategy):
            def trainer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
                return checkpoint

            def restore_extras(self, meta: dict[str, Any], *, fitting: bool) -> None:
                pass

    with pytest.raises(TypeError, match=r"Mixed defines \['restore_extras'\]"):

        class Mixed(Extras, BucketedDDPStrategy):
            pass
