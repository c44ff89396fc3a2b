"""A save that dies part-way never costs the previous checkpoint, and every kind of checkpoint exports.

Each case saves a good checkpoint at step 2, then dies while overwriting it at step 4 (a rank exits with the
process's own ``os._exit``, as a kill would), then resumes: it must resume from step 2. The points of death:
``mid_shards`` rank 1 before it writes its shard files, while rank 0 writes its own (a half-written staging
directory); ``shards`` rank 1 after every shard is written, before the swap; ``publish`` rank 0 between the two
renames of the swap (no ``last.ckpt`` at all, only the previous one as ``last.old.ckpt``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, train_tiny_gpt

from lightscale.checkpoint import portable as layout
from lightscale.cli import main
from lightscale.recipes.gpt import GPT, GPTConfig
from lightscale.storage import atomic_dir
from lightscale.strategies.deepspeed import checkpoint as deepspeed_dir
from lightscale.strategies.deepspeed.strategy import ZeroStrategy
from lightscale.testing import RankFailed, run_distributed


def _die_on_rank_1() -> None:
    if dist.get_rank() == 1:
        os._exit(1)


def _after(function: Any) -> Any:
    """``function``, then rank 1 dies: its shards are written, nothing is published."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        _die_on_rank_1()
        return result

    return wrapped


def _publish_half(staging: Path, target: Path) -> None:
    """The first rename of ``publish`` (target -> previous), then death: the moment with no ``target``."""
    target.rename(atomic_dir.previous_path(target))
    os._exit(1)


def _before(function: Any) -> Any:
    """Rank 1 dies where it would call ``function`` (its first shard write); other ranks call it."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _die_on_rank_1()
        return function(*args, **kwargs)

    return wrapped


def _death_between_shard_writes(strategy: str) -> Any:
    if strategy.startswith("zero"):  # DeepSpeed writes each shard file through its checkpoint engine
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        return mock.patch.object(TorchCheckpointEngine, "save", _before(TorchCheckpointEngine.save))
    from torch.distributed.checkpoint import FileSystemWriter

    return mock.patch.object(FileSystemWriter, "write_data", _before(FileSystemWriter.write_data))


def _shards_then_death(strategy: str) -> Any:
    if strategy.startswith("zero"):
        from deepspeed.runtime.engine import DeepSpeedEngine

        return mock.patch.object(DeepSpeedEngine, "save_checkpoint", _after(DeepSpeedEngine.save_checkpoint))
    import torch.distributed.checkpoint as dcp

    return mock.patch.object(dcp, "save", _after(dcp.save))


def _train(strategy: str, cache_dir: str, checkpoint: str, *, steps: int, resume: bool, fault: str = "") -> list[float]:
    """This rank's loss of each step trained (from the resumed step on), saving ``checkpoint`` after ``steps``."""
    user = deepspeed_dir if strategy.startswith("zero") else layout  # the module that calls publish
    patch = {
        "mid_shards": _death_between_shard_writes(strategy),
        "shards": _shards_then_death(strategy),
        "publish": mock.patch.object(user, "publish", _publish_half),
    }
    saver = _SaveAt(steps, checkpoint)
    with patch.get(fault, mock.patch.dict({})):
        train_tiny_gpt(
            _strategy(strategy),
            config=_config(strategy),
            devices=2,
            batch_size=4,
            max_steps=steps,
            cache_dir=cache_dir,
            extra_callbacks=[saver],
            resume_from=checkpoint if resume else None,
            default_root_dir=str(Path(checkpoint).parent),
        )
    return saver.losses


def _strategy(name: str) -> Any:
    # zero2 here saves DeepSpeed's engine directory (its own atomic path); ZeRO's default format goes through the
    # same DCP writer as fsdp2's.
    return ZeroStrategy(stage=2, checkpoint_format="deepspeed") if name == "zero2" else name


def _config(strategy: str) -> GPTConfig:
    # Pipeline stages hold different layers (each rank saves its own); the GPT ties embedding and head only
    # without pipelines.
    return dataclasses.replace(TINY, tie_weights=False) if strategy.startswith("pp") else TINY


class _SaveAt(pl.Callback):
    """``trainer.save_checkpoint(path)`` at ``step``: the same name every time, so a save overwrites the last one
    (ModelCheckpoint would write ``last-v1.ckpt`` beside an existing ``last.ckpt`` instead). Before saving, each
    rank writes its losses so far to ``losses/<rank>.json``: the record of a run that dies in the save."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step == self.step:
            _losses_file(self.path, trainer.global_rank).write_text(json.dumps(self.losses))
            trainer.save_checkpoint(self.path)


def _losses_file(checkpoint: str, rank: int) -> Path:
    directory = Path(checkpoint).parent / "losses"
    directory.mkdir(exist_ok=True)
    return directory / f"{rank}.json"


@pytest.mark.parametrize("fault", ["mid_shards", "shards", "publish"])
@pytest.mark.parametrize("strategy", ["fsdp2", "zero2"])
def test_a_save_killed_part_way_keeps_the_previous_checkpoint(
    strategy: str, fault: str, corpus_cache: str, tmp_path: Path
) -> None:
    checkpoint = str(tmp_path / "last.ckpt")
    run_distributed(_train, strategy, corpus_cache, checkpoint, steps=2, resume=False, world_size=2, timeout_s=300)
    with pytest.raises(RankFailed):
        run_distributed(
            _train, strategy, corpus_cache, checkpoint, steps=4, resume=True, fault=fault, world_size=2, timeout_s=300
        )
    if fault == "publish":  # died where it meant to: the only complete checkpoint is the previous one, renamed
        assert not (tmp_path / "last.ckpt").exists() and (tmp_path / "last.old.ckpt").is_dir()
    else:  # died while writing the new checkpoint beside the previous one
        assert (tmp_path / "last.ckpt.tmp").is_dir() and (tmp_path / "last.ckpt").is_dir()
    resumed = run_distributed(_train, strategy, corpus_cache, checkpoint, steps=4, resume=True, world_size=2)
    # Resumed from step 2 with step 2's weights and optimizer state: steps 3 and 4 repeat the dead run's losses.
    assert resumed == [json.loads(_losses_file(checkpoint, rank).read_text()) for rank in range(2)]
    assert [len(losses) for losses in resumed] == [2, 2]
    assert sorted(path.name for path in tmp_path.iterdir() if "ckpt" in path.name) == ["last.ckpt"]  # no left-overs


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero3", "fsdp2", "tp2", "pp2"])
def test_export_reads_every_strategy(strategy: str, corpus_cache: str, tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "last.ckpt")
    run_distributed(_train, strategy, corpus_cache, checkpoint, steps=2, resume=False, world_size=2, timeout_s=300)
    main(["export", checkpoint, str(tmp_path / "gpt.pt")])
    state = torch.load(tmp_path / "gpt.pt", weights_only=True)
    GPT(_config(strategy)).load_state_dict(state)  # strict: every weight, full shapes
