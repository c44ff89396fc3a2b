"""Exact resume: 10 steps, save, resume, 10 more = 20 uninterrupted steps (same losses, same data)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import TINY, train_tiny_gpt

from lightscale.testing import run_distributed

TOLERANCE = 1e-6  # the resumed run replays the same arithmetic; only save/load round-off could differ


def _interrupted(strategy: str, cache_dir: str, checkpoint: str) -> list[float]:
    first = train_tiny_gpt(
        strategy, devices=2, batch_size=4, stop_after=10, cache_dir=cache_dir, save_checkpoint_to=checkpoint
    )
    second = train_tiny_gpt(
        strategy, devices=2, batch_size=4, max_steps=20, cache_dir=cache_dir, resume_from=checkpoint
    )
    return first + second


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero2", "zero3_offload"])
def test_resume_equals_uninterrupted(strategy: str, corpus_cache: str, tmp_path) -> None:
    uninterrupted = run_distributed(
        train_tiny_gpt, strategy, devices=2, batch_size=4, cache_dir=corpus_cache, world_size=2, timeout_s=600
    )[0]
    resumed = run_distributed(
        _interrupted, strategy, corpus_cache, str(tmp_path / "interrupted.ckpt"), world_size=2, timeout_s=600
    )[0]
    assert len(resumed) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, uninterrupted, strict=True)) <= TOLERANCE


def _dropout_runs(cache_dir: str, checkpoint: str) -> tuple[list[float], list[float]]:
    config = dataclasses.replace(TINY, dropout=0.2)
    common = {"devices": 2, "batch_size": 4, "cache_dir": cache_dir, "config": config, "seed_per_rank": True}
    uninterrupted = train_tiny_gpt("bucketed_ddp", max_steps=8, **common)
    first = train_tiny_gpt("bucketed_ddp", stop_after=4, save_checkpoint_to=checkpoint, max_steps=8, **common)
    # seed_everything at the start of the second fit resets every generator: only the checkpoint brings them back
    second = train_tiny_gpt("bucketed_ddp", max_steps=8, resume_from=checkpoint, **common)
    return uninterrupted, first + second


def test_resume_restores_each_ranks_random_state(corpus_cache: str, tmp_path) -> None:
    """With dropout and a different random state per rank, the resumed steps draw the masks they would have drawn."""
    uninterrupted, resumed = run_distributed(
        _dropout_runs, corpus_cache, str(tmp_path / "dropout.ckpt"), world_size=2, timeout_s=300
    )[0]
    assert len(resumed) == 8
    assert resumed == uninterrupted  # same arithmetic, same masks: bitwise
