"""What one launch of the conformance matrix runs on every rank: each zoo model under one strategy name.

Per model: an uninterrupted fit of ``STEPS`` steps saving at ``SAVE_AT`` (``mid.ckpt``) and at the end
(``final.ckpt``), then a fit resumed from ``mid.ckpt`` saving at the end (``resumed.ckpt``). An exception is caught
and reported with whether any training step had begun (a refusal must come before one), and the next model runs.
The one-process reference is the same fit under Lightning's own single-device strategy.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from behaviours import run as run_behaviours
from helpers import StepLosses, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset
from zoo import GLOBAL_BATCH, ZOO, batch, build

import lightscale

STEPS, SAVE_AT = 4, 2


@dataclasses.dataclass
class Run:
    """One fit on one rank: the global loss of each step, or the error and the optimizer steps taken before it."""

    losses: list[float]
    error: str | None = None
    steps: int = 0


@dataclasses.dataclass
class Cell:
    """A model under a name on one rank: the uninterrupted and the resumed fit."""

    fit: Run
    resumed: Run | None


class _SaveAndWatch(pl.Callback):
    def __init__(self, saves: dict[int, Path]) -> None:
        self.saves, self.steps = saves, 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps = trainer.global_step
        if trainer.global_step in self.saves:
            trainer.save_checkpoint(self.saves[trainer.global_step])


def _loader(model: str, shards: tuple[int, int]) -> DataLoader:
    index, count = shards
    mine = [tensor[index::count] for tensor in batch(ZOO[model])]  # the shards' batches make the global one
    return DataLoader(TensorDataset(*mine), batch_size=GLOBAL_BATCH // count)


def _fit(strategy: Any, model: str, saves: dict[int, Path], ckpt_path: Path | None = None) -> Run:
    # Each rank its own seed: only a strategy that starts every rank from rank 0's weights matches one process.
    seed = dist.get_rank()
    pl.seed_everything(seed, verbose=False)
    watch, losses = _SaveAndWatch(saves), StepLosses()
    try:
        trainer = quiet_trainer(
            strategy,
            devices=dist.get_world_size(),
            max_steps=STEPS,
            callbacks=[losses, watch],
            use_distributed_sampler=False,
            default_root_dir=next(iter(saves.values())).parent,  # zero_infinity's swap
        )
        shards = tuple(lightscale.data_shard())  # known once the Trainer exists: dp x ep shards
        trainer.fit(build(model, seed), _loader(model, shards), ckpt_path=ckpt_path)
    except Exception as error:
        return Run(losses.steps, f"{type(error).__name__}: {error}", watch.steps)
    return Run(losses.steps, None, watch.steps)


def run_name(name: str, root: str, models: list[str], *, behaviours: bool) -> dict[str, Any]:
    """On every rank of a launch: each of ``models`` under strategy ``name``; checkpoints under root/name/model;
    then, with ``behaviours``, Lightning's behaviours (behaviours.py) under the key ``"behaviours"``."""
    cells: dict[str, Any] = {}
    for model in models:
        directory = Path(root) / name / model
        fit = _fit(name, model, {SAVE_AT: directory / "mid.ckpt", STEPS: directory / "final.ckpt"})
        resumed = None
        if fit.error is None:
            resumed = _fit(name, model, {STEPS: directory / "resumed.ckpt"}, ckpt_path=directory / "mid.ckpt")
        cells[model] = Cell(fit, resumed)
        dist.barrier()
    if behaviours:
        try:
            cells["behaviours"] = run_behaviours(name, Path(root) / name / "behaviours")
        except Exception as error:
            cells["behaviours"] = {"error": f"{type(error).__name__}: {error}"}
    return cells


def one_process(models: list[str], root: str) -> dict[str, dict[str, Any]]:
    """Lightning's own single-device fit of each model: its losses and trained ``state_dict``."""
    out = {}
    for model in models:
        pl.seed_everything(0, verbose=False)
        losses = StepLosses()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=STEPS,
            callbacks=[losses],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
        )
        module = build(model)
        trainer.fit(module, _loader(model, (0, 1)))
        state = {key: value.detach().clone() for key, value in module.state_dict().items()}
        out[model] = {"losses": losses.steps, "state": state}
    out["behaviours"] = run_behaviours("auto", Path(root) / "one_process_behaviours", plain=True)
    return out
