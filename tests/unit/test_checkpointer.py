"""A strategy owns its checkpoint IO (``strategy.checkpointer``, lightscale/strategies/checkpointer.py): a family whose
checkpoints differ names a Checkpointer subclass, and a strategy written for the former checkpoint base class (methods
such as ``trainer_state`` on the strategy) is refused when the class is defined, not silently never called."""

from __future__ import annotations

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
    assert type(fsdp2.checkpointer).__name__ == "FaultTolerantCheckpointer" and fsdp2.checkpointer.writer is not None
    assert type(ZeroStrategy(stage=2).checkpointer).__name__ == "ZeroCheckpointer"


def test_async_save_is_refused_where_the_checkpointer_does_not_save_the_layout() -> None:
    with pytest.raises(ConfigurationError, match=r"async_save=True is not supported by DiLoCoStrategy.*FSDP2Strategy"):
        DiLoCoStrategy(workers=2, async_save=True)


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
