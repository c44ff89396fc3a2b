"""parallel_3d checkpoints: sharded (torch.distributed.checkpoint) save and exact resume on the same mesh."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from helpers import TINY, train_tiny_gpt

from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import run_distributed

PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
STEPS, STOP = 6, 3


def _fit(cache_dir: str, **kwargs: object) -> list[float]:
    strategy = Parallel3DStrategy(dp=1, tp=2, pp=2, microbatches=2)
    return train_tiny_gpt(strategy, devices=4, batch_size=8, config=PIPELINED, cache_dir=cache_dir, **kwargs)


def _interrupted(cache_dir: str, checkpoint: str) -> list[float]:
    first = _fit(cache_dir, max_steps=STEPS, stop_after=STOP, save_checkpoint_to=checkpoint)
    return first + _fit(cache_dir, max_steps=STEPS, resume_from=checkpoint)


def test_resume_equals_uninterrupted(corpus_cache: str, tmp_path: Path) -> None:
    uninterrupted = run_distributed(_fit, corpus_cache, max_steps=STEPS, world_size=4, timeout_s=600)[0]
    checkpoint = tmp_path / "interrupted.ckpt"
    resumed = run_distributed(_interrupted, corpus_cache, str(checkpoint), world_size=4, timeout_s=600)[0]
    assert checkpoint.is_dir() and (checkpoint / "trainer_state.pt").is_file()
    assert len(list(checkpoint.glob("*.distcp"))) == 4, "one shard file per rank"
    assert resumed == uninterrupted  # same arithmetic after the restore: bit-exact
