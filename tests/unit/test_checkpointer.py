"""A strategy owns its checkpoint IO (``strategy.checkpointer``, lightscale/strategies/checkpointer.py), one class for
every family: a family hands its own state over as named ``Stateful`` objects (``checkpoint_states``), says what
module a rank's checkpoint holds (``checkpoint_module``) and, where writing itself differs, names one writer object
(``checkpoint_writer``); ``async_save`` runs in the portable writer only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from lightscale.errors import ConfigurationError
from lightscale.strategies import BucketedDDPStrategy, Checkpointer, DiLoCoStrategy, FSDP2Strategy, ZeroStrategy
from lightscale.strategies.checkpointer import PORTABLE
from lightscale.strategies.deepspeed.checkpoint import ZeroWriter


class Tag:
    """A user's state beside Lightning's: saved as ``lightscale.tag``, given back on resume."""

    def __init__(self) -> None:
        self.value = "mine"

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class TaggedDDP(BucketedDDPStrategy):  # no aliases: not registered
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = Tag()
        self.view = nn.Linear(2, 2)

    def checkpoint_states(self) -> dict[str, Stateful]:
        return {**super().checkpoint_states(), "tag": self.tag}

    def checkpoint_module(self) -> nn.Module:
        return self.view


def test_every_strategy_owns_the_one_checkpointer_built_from_its_settings() -> None:
    strategy = TaggedDDP(checkpoint_format="file")
    assert type(strategy.checkpointer) is Checkpointer and strategy.checkpointer.strategy is strategy
    assert strategy.checkpointer.format == "file" and strategy.checkpointer.writer is None
    assert strategy.checkpoint_states()["tag"] is strategy.tag and TaggedDDP.checkpoint_writer is PORTABLE
    with strategy.checkpointer.module() as module:  # what a rank's checkpoint holds is the strategy's answer
        assert module is strategy.view
    fsdp2 = FSDP2Strategy(async_save=True)
    assert type(fsdp2.checkpointer) is Checkpointer and fsdp2.checkpointer.writer is not None
    zero = ZeroStrategy(stage=2)
    assert type(zero.checkpointer) is Checkpointer and isinstance(ZeroStrategy.checkpoint_writer, ZeroWriter)


def test_no_family_subclasses_the_checkpointer() -> None:
    assert Checkpointer.__subclasses__() == []


def test_async_save_is_refused_where_the_writer_is_not_the_portable_one() -> None:
    with pytest.raises(ConfigurationError, match=r"async_save=True is not supported by DiLoCoStrategy.*FSDP2Strategy"):
        DiLoCoStrategy(workers=2, async_save=True)
    with pytest.raises(ConfigurationError, match=r"async_save=True is not supported by ZeroStrategy"):
        ZeroStrategy(stage=2, async_save=True)


class SidecarDDP(BucketedDDPStrategy):  # a user's strategy that writes a file beside Lightning's checkpoint
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        (Path(filepath) / "sidecar.txt").write_text("mine")


def test_async_save_is_refused_where_the_strategy_overrides_save_checkpoint() -> None:
    # The background writer publishes the directory after the override wrote its sidecar into it: async_save cannot
    # honour it, so it is refused before work starts, naming the override and where the state goes instead.
    with pytest.raises(
        ConfigurationError,
        match=r"async_save=True is not supported with SidecarDDP\.save_checkpoint.*"
        r"named Stateful objects.*`checkpoint_states`.*async_save=False",
    ):
        SidecarDDP(async_save=True)
    assert SidecarDDP().checkpointer.writer is None  # synchronous saving is the user's own
    assert TaggedDDP(async_save=True).checkpointer.writer is not None  # state handed over keeps async_save
