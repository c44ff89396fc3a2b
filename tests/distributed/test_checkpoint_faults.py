"""A save that dies part-way never costs the previous checkpoint, and every kind of checkpoint exports.

Each case saves a good checkpoint at step 2, then dies while overwriting it at step 4 (a rank exits with the
process's own ``os._exit``, as a kill would), then resumes: it must resume from step 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from helpers import train_tiny_gpt

from lightscale.cli import main
from lightscale.plugins import atomic_dir, distributed_checkpoint
from lightscale.recipes.gpt import GPT
from lightscale.strategies import zero
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
    """The first rename of ``publish`` (target -> .old), then death: the moment with no ``target``."""
    target.rename(atomic_dir.previous_path(target))
    os._exit(1)


def _shards_then_death(strategy: str) -> Any:
    if strategy.startswith("zero"):
        from deepspeed.runtime.engine import DeepSpeedEngine

        return mock.patch.object(DeepSpeedEngine, "save_checkpoint", _after(DeepSpeedEngine.save_checkpoint))
    import torch.distributed.checkpoint as dcp

    return mock.patch.object(dcp, "save", _after(dcp.save))


def _train(strategy: str, cache_dir: str, checkpoint: str, *, steps: int, resume: bool, fault: str = "") -> int:
    user = zero if strategy.startswith("zero") else distributed_checkpoint  # the module that calls publish
    patch = {"shards": _shards_then_death(strategy), "publish": mock.patch.object(user, "publish", _publish_half)}
    with patch.get(fault, mock.patch.dict({})):
        losses = train_tiny_gpt(
            strategy,
            devices=2,
            batch_size=4,
            max_steps=steps,
            stop_after=steps,
            cache_dir=cache_dir,
            save_checkpoint_to=checkpoint,
            resume_from=checkpoint if resume else None,
            default_root_dir=str(Path(checkpoint).parent),
        )
    return len(losses)


@pytest.mark.parametrize("fault", ["shards", "publish"])
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
    steps = run_distributed(_train, strategy, corpus_cache, checkpoint, steps=4, resume=True, world_size=2)
    assert steps == [2, 2]  # resumed from step 2: the step-4 save never replaced it
    assert not (tmp_path / "last.ckpt.tmp").exists() and not (tmp_path / "last.ckpt.old").exists()


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero3", "fsdp2", "tp2"])
def test_export_reads_every_strategy(strategy: str, corpus_cache: str, tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "last.ckpt")
    run_distributed(_train, strategy, corpus_cache, checkpoint, steps=2, resume=False, world_size=2, timeout_s=300)
    main(["export", checkpoint, str(tmp_path / "gpt.pt")])
    state = torch.load(tmp_path / "gpt.pt", weights_only=True)
    from helpers import TINY

    GPT(TINY).load_state_dict(state)  # strict: every weight, full shapes
