"""parallel_3d: losses match single-process SGD training for every mesh shape and schedule (fp32, gloo ranks).

The registered aliases, clipping and accumulation with a pipeline are in test_parity.py.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
from helpers import SGD_LR, TINY, relative_difference, train_tiny_gpt

from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # relative, per step (measured ~1e-7 in fp32)
STEPS = 10
GLOBAL_BATCH = 8
PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)  # 4 layers: 2 stages per rank for interleaved


@cache
def _reference(pipelined: bool, cache_dir: str) -> tuple[float, ...]:
    config = PIPELINED if pipelined else TINY
    losses = run_distributed(
        train_tiny_gpt,
        "auto",
        devices=1,
        batch_size=GLOBAL_BATCH,
        max_steps=STEPS,
        config=config,
        cache_dir=cache_dir,
        sgd_lr=SGD_LR,
        world_size=1,
    )[0]
    return tuple(losses)


def _fit_3d(dp: int, tp: int, pp: int, cache_dir: str, **options) -> list[float]:
    config = PIPELINED if pp > 1 else TINY
    strategy = Parallel3DStrategy(dp=dp, tp=tp, pp=pp, **options)
    world = dp * tp * pp
    per_rank = run_distributed(
        train_tiny_gpt,
        strategy,
        devices=world,
        batch_size=GLOBAL_BATCH // dp,
        max_steps=STEPS,
        config=config,
        cache_dir=cache_dir,
        sgd_lr=SGD_LR,
        local_losses=True,
        world_size=world,
        timeout_s=600,
    )
    # Each rank's own loss: ranks of one data-parallel group share it, so the mean over all ranks is the dp mean.
    losses = [sum(step) / world for step in zip(*per_rank, strict=True)]
    assert relative_difference(losses, list(_reference(pp > 1, cache_dir))) <= TOLERANCE
    return losses


def test_tensor_parallel_matches(corpus_cache: str) -> None:
    _fit_3d(1, 2, 1, corpus_cache)


@pytest.mark.parametrize(
    ("schedule", "microbatches"),
    [("gpipe", 2), ("1f1b", 2), ("1f1b", 4), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2)],
)
def test_pipeline_schedules_match(schedule: str, microbatches: int, corpus_cache: str) -> None:
    _fit_3d(1, 1, 2, corpus_cache, schedule=schedule, microbatches=microbatches)


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 1), (2, 1, 2)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_combined_meshes_match(dp: int, tp: int, pp: int, schedule: str, corpus_cache: str) -> None:
    if pp == 1 and schedule == "gpipe":
        pytest.skip("no pipeline: the schedule is unused")
    _fit_3d(dp, tp, pp, corpus_cache, schedule=schedule)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_eight_ranks_match(schedule: str, corpus_cache: str) -> None:
    _fit_3d(2, 2, 2, corpus_cache, schedule=schedule)


def test_replicated_data_parallel_matches(corpus_cache: str) -> None:
    _fit_3d(2, 1, 2, corpus_cache, dp_mode="replicate")
