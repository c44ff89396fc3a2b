"""The resharding matrix of the portable checkpoint layout, factored into legs that each load, train and save.

Every strategy writes one layout, so the matrix is not savers x loaders: each *leg* runs one member (a strategy at
a world size) that loads a checkpoint, trains a few steps, and saves. One leg checks, for its member,
    * as a loader: the live state right after loading (gathered parameters, Adam moments, step counters, parameter
      groups) equals the live state its predecessor saved, bitwise;
    * as a saver: the checkpoint read offline (DCP ``no_dist``, no process group) equals the live state at the save,
      bitwise, and holds every tensor of it;
    * the losses after loading equal an uninterrupted run.
Legs of one world size run in one launch (imports and process-group start-up once).

A member is a row ``(name, world_size, strategy factory)``; a strategy family that gathers its live state another way
(a DeepSpeed engine) gives ``live_state`` too. What is trained is a :class:`Workload`: the GPT recipe by default.

Example:
    >>> MEMBERS.append(Member("zero2", 2, lambda: ZeroStrategy(stage=2), live_state=zero_live_state))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from helpers import TINY, train_tiny_gpt
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from lightscale.checkpoint.portable import TRAINER_STATE
from lightscale.recipes.gpt import GPT, GPTConfig
from lightscale.storage.safe_dcp import SafeFileSystemReader, load_safely

# Untied embeddings and 2 blocks: every pipeline split of the GPT recipe is possible (tied weights cannot span stages).
CONFIG = dataclasses.replace(TINY, n_layer=2, tie_weights=False)
GLOBAL_BATCH = 8
State = dict[str, Any]  # flattened like DCP's keys: "model.<fqn>", "optimizer.state.<fqn>.exp_avg", ...


def torch_live_state(trainer: pl.Trainer) -> State:
    """This rank's view of the full model and optimizer state: DTensors gathered, pipeline stages its own only."""
    strategy = trainer.strategy
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    with strategy.checkpointer.module() as module:
        model, optim = get_state_dict(module, strategy.optimizers, options=options)
    state = {f"model.{k}": v for k, v in model.items()} | {f"optimizer.{k}": v for k, v in optim.items()}
    return {k: _copy(v) for k, v in state.items()}


def _copy(value: Any) -> Any:
    """A snapshot: training goes on updating the live tensors in place."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value.detach().clone() if isinstance(value, Tensor) else value


class Workload(Protocol):
    """A model and its data: fits under ``strategy`` and returns the global loss of every optimizer step."""

    def fit(
        self,
        strategy: Any,
        *,
        devices: int,
        batch_size: int,
        cache_dir: str,
        max_steps: int,
        callbacks: list[pl.Callback],
        resume_from: str | None,
    ) -> list[float]: ...

    def state_names(self) -> set[str]:
        """The LightningModule's own ``state_dict`` keys: the names every checkpoint must use."""
        ...


@dataclasses.dataclass(frozen=True)
class GPTWorkload:
    """The GPT recipe (AdamW, warm-up then cosine schedule) on its default corpus."""

    config: GPTConfig = dataclasses.field(default_factory=lambda: CONFIG)

    def fit(self, strategy: Any, *, callbacks: list[pl.Callback], **kwargs: Any) -> list[float]:
        return train_tiny_gpt(strategy, config=self.config, extra_callbacks=callbacks, **kwargs)

    def state_names(self) -> set[str]:
        return {f"model.{name}" for name in GPT(self.config).state_dict()}


@dataclasses.dataclass(frozen=True)
class Member:
    """A strategy at a world size: one row of the matrix."""

    name: str
    world_size: int
    strategy: Callable[[], Any]
    live_state: Callable[[pl.Trainer], State] = torch_live_state

    def batch_per_rank(self) -> int:
        shards = self.strategy().parallel_dims(self.world_size).data_shards
        return GLOBAL_BATCH // shards


@dataclasses.dataclass(frozen=True)
class Leg:
    """``member`` resumes from ``load`` (``None``: from scratch), trains to step ``until`` and saves ``save`` at
    step ``save_at`` (default: ``until``). Every leg plans ``max_steps`` (the LR schedule spans them) and stops at
    ``until``, the way an interrupted job does."""

    member: Member
    load: str | None
    save: str
    until: int
    max_steps: int
    save_at: int | None = None
    workload: Workload = dataclasses.field(default_factory=GPTWorkload)


@dataclasses.dataclass
class LegResult:
    losses: list[float]
    loaded: State | None  # live state when training starts after a load
    saved: State  # live state when the checkpoint was written
    saved_step: int


class _Observe(pl.Callback):
    """Gathers the live state after the load and at the save; saves at ``save_at``."""

    def __init__(self, leg: Leg) -> None:
        self.leg = leg
        self.loaded: State | None = None
        self.saved: State = {}
        self.saved_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.leg.load is not None:
            self.loaded = self._snapshot(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == (self.leg.save_at or self.leg.until):
            trainer.save_checkpoint(self.leg.save)
        if trainer.global_step >= self.leg.until:
            trainer.should_stop = True

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.saved = self._snapshot(trainer)
        self.saved_step = trainer.global_step

    def _snapshot(self, trainer: pl.Trainer) -> State:
        """The member's live state plus the loop's step and the LR schedulers' state (trainer_state.pt's part)."""
        schedulers = [deepcopy(config.scheduler.state_dict()) for config in trainer.lr_scheduler_configs]
        loop = {"trainer.global_step": trainer.global_step, "trainer.lr_schedulers": schedulers}
        return self.leg.member.live_state(trainer) | loop


def run_legs(legs: list[Leg], cache_dir: str) -> list[LegResult]:
    """On every rank of this launch: run ``legs`` in order (a later leg may load an earlier one's checkpoint)."""
    results = []
    for leg in legs:
        observe = _Observe(leg)
        losses = leg.workload.fit(
            leg.member.strategy(),
            devices=dist.get_world_size(),
            batch_size=leg.member.batch_per_rank(),
            cache_dir=cache_dir,
            max_steps=leg.max_steps,
            callbacks=[observe],
            resume_from=leg.load,
        )
        results.append(LegResult(losses, observe.loaded, observe.saved, observe.saved_step))
        dist.barrier()
    return results


def merge_ranks(states: list[State | None]) -> State:
    """One full state from every rank's view; where ranks hold the same key (replicas) they must agree bitwise."""
    merged: State = {}
    for state in states:
        for key, value in (state or {}).items():
            if key in merged:
                assert same(merged[key], value), f"ranks disagree on {key}"
            merged[key] = value
    return merged


def same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def read_offline(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of checkpoint ``path`` at its global shape, read in this process without a process group."""
    entries = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    full = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    load_safely(full, Path(path), no_dist=True)
    return full


def check_saved(path: str, saved: State, step: int, *, names: set[str]) -> None:
    """The checkpoint holds exactly the live tensors at the save, bitwise, its model entries named ``names`` (the
    LightningModule's own); Adam's step counters equal ``step``."""
    assert (Path(path) / TRAINER_STATE).is_file()
    offline = read_offline(path)
    assert {key for key in offline if key.startswith("model.")} == {f"model.{name}" for name in names}
    live = {key: value for key, value in saved.items() if isinstance(value, Tensor)}
    assert sorted(offline) == sorted(live)
    for key, tensor in live.items():
        assert same(offline[key], tensor), key
    steps = [value for key, value in live.items() if key.endswith(".step")]
    assert steps and all(float(value) == step for value in steps)
    assert any(key.endswith(".exp_avg_sq") for key in live)


def check_loaded(loaded: State, saved: State) -> None:
    """Parameters, moments, step counters, parameter groups, the global step and the LR schedulers' state after
    the load equal those at the save, bitwise. Hyper-parameters only one optimizer has (DeepSpeed's CPU Adam keeps
    ``bias_correction``, torch's AdamW ``foreach``...) are compared where both have them."""
    only_one = loaded.keys() ^ saved.keys()
    assert all(key.startswith(_GROUPS) for key in only_one), sorted(only_one)[:8]
    for key in loaded.keys() & saved.keys():
        assert same(loaded[key], saved[key]), key


_GROUPS = "optimizer.param_groups."


def zero_live_state(trainer: pl.Trainer) -> State:
    """A ZeRO engine's full state (collective): fp32 masters and the optimizer's per-element state gathered with
    DeepSpeed's public ``safe_get_full_*`` calls, its scalar states and each group's hyper-parameters, keyed like the
    layout (any torch optimizer: Adam's moments and step, SGD's momentum buffer, ...)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from lightscale.strategies.deepspeed.portable_save import optimizer_state

    strategy = trainer.strategy
    zero = strategy.engine.optimizer
    keys, scalars = optimizer_state(zero)  # ZeRO-1/2 link their per-parameter views of the state lazily
    state: State = {}
    for name, param in strategy.lightning_module.named_parameters():
        state[f"model.{name}"] = safe_get_full_fp32_param(param).cpu().clone()
        for key in keys:
            state[f"optimizer.state.{name}.{key}"] = safe_get_full_optimizer_state(param, key).cpu().clone()
        state |= {f"optimizer.state.{name}.{key}": value.clone() for key, value in scalars.items()}
    for group, names in zip(zero.optimizer.param_groups, strategy.group_names, strict=True):
        settings = {key: value for key, value in group.items() if key != "params" and not key.startswith("_")}
        state |= {
            f"optimizer.param_groups.{name}.{key}": _copy(value) for name in names for key, value in settings.items()
        }
    return state


def zero_member(name: str, world_size: int, **options: Any) -> Member:
    """A ZeRO strategy as a matrix row, named ``<name>@<world_size>``."""
    from lightscale.strategies import ZeroStrategy

    return Member(f"{name}@{world_size}", world_size, lambda: ZeroStrategy(**options), live_state=zero_live_state)
