"""bucketed_ddp on 2 ranks reproduces single-process training step by step (fp32, same data and seed)."""

from __future__ import annotations

import pytest
from helpers import relative_difference, train_tiny_gpt

from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # relative, per step; fp32 reassociation of the gradient sum stays far below this
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def single_process_losses(corpus_cache: str) -> list[float]:
    return run_distributed(
        train_tiny_gpt, "auto", devices=1, batch_size=GLOBAL_BATCH, cache_dir=corpus_cache, world_size=1
    )[0]


def test_matches_single_process(single_process_losses: list[float], corpus_cache: str) -> None:
    per_rank = run_distributed(
        train_tiny_gpt, "bucketed_ddp", devices=2, batch_size=GLOBAL_BATCH // 2, cache_dir=corpus_cache, world_size=2
    )
    assert per_rank[0] == per_rank[1]  # every rank logs the same global loss
    assert len(per_rank[0]) == 20
    assert relative_difference(per_rank[0], single_process_losses) <= TOLERANCE
    assert single_process_losses[-1] < single_process_losses[0] - 0.5  # it learned: the comparison is not vacuous


def test_matches_single_process_with_gradient_accumulation(
    single_process_losses: list[float], corpus_cache: str
) -> None:
    per_rank = run_distributed(
        train_tiny_gpt,
        "bucketed_ddp",
        devices=2,
        batch_size=GLOBAL_BATCH // 4,
        accumulate=2,
        cache_dir=corpus_cache,
        world_size=2,
    )
    assert relative_difference(per_rank[0], single_process_losses) <= TOLERANCE


def test_small_buckets_and_bf16_wire_still_train(single_process_losses: list[float], corpus_cache: str) -> None:
    from lightscale.strategies import BucketedDDPStrategy

    strategy = BucketedDDPStrategy(bucket_cap_mb=0.01, first_bucket_cap_mb=0.005, compression="bf16")
    per_rank = run_distributed(
        train_tiny_gpt, strategy, devices=2, batch_size=GLOBAL_BATCH // 2, cache_dir=corpus_cache, world_size=2
    )
    # bf16 rounds each averaged gradient to 8 bits of mantissa: close to fp32 training, not equal.
    assert relative_difference(per_rank[0], single_process_losses) <= 2e-2
