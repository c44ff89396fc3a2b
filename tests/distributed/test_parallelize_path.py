"""One parallelize path: the same degrees give the same program whichever strategy name chose them."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import SGD_LR, relative_difference, train_tiny_gpt

from lightscale.strategies import FSDP2Strategy, Parallel3DStrategy
from lightscale.testing import run_distributed

STEPS = 6


def _local_losses(strategy: Any, cache_dir: str, ranks: int = 2, dp: int = 2, **kwargs: Any) -> list[list[float]]:
    return run_distributed(
        train_tiny_gpt,
        strategy,
        devices=ranks,
        batch_size=8 // dp,
        max_steps=STEPS,
        cache_dir=cache_dir,
        sgd_lr=SGD_LR,
        local_losses=True,
        world_size=ranks,
        timeout_s=600,
        **kwargs,
    )


def test_parallel_3d_with_only_dp_is_fsdp2_bit_for_bit(corpus_cache: str) -> None:
    fsdp2 = _local_losses("fsdp2", corpus_cache)
    parallel_3d = _local_losses(Parallel3DStrategy(dp=2), corpus_cache)
    assert parallel_3d == fsdp2  # every rank, every step, exactly


def test_parallel_3d_with_only_dp_is_fsdp2_bit_for_bit_in_bf16(corpus_cache: str) -> None:
    fsdp2 = _local_losses("fsdp2", corpus_cache, precision="bf16-mixed")
    parallel_3d = _local_losses(Parallel3DStrategy(dp=2), corpus_cache, precision="bf16-mixed")
    assert parallel_3d == fsdp2  # the same MixedPrecisionPolicy, not autocast


@pytest.fixture(scope="module")
def reference(corpus_cache: str) -> list[float]:
    return _local_losses("auto", corpus_cache, ranks=1, dp=1)[0]


def _mean(per_rank: list[list[float]]) -> list[float]:
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_under_tensor_parallel(mode: str, reference: list[float], corpus_cache: str) -> None:
    strategy = Parallel3DStrategy(tp=2, dp=1, activation_checkpointing=mode)
    assert relative_difference(_mean(_local_losses(strategy, corpus_cache, dp=1)), reference) <= 1e-5


def test_compile_under_parallel_3d(reference: list[float], corpus_cache: str) -> None:
    strategy = Parallel3DStrategy(dp=2, compile=True, activation_checkpointing="full")
    # Inductor's kernels reassociate sums differently from eager: close, not equal.
    assert relative_difference(_mean(_local_losses(strategy, corpus_cache)), reference) <= 1e-4


def test_fsdp2_compile_matches_parallel_3d_compile(corpus_cache: str) -> None:
    fsdp2 = _local_losses(FSDP2Strategy(compile=True), corpus_cache)
    parallel_3d = _local_losses(Parallel3DStrategy(dp=2, compile=True), corpus_cache)
    assert parallel_3d == fsdp2
