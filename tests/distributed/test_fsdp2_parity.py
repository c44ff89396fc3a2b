"""The FSDP2 strategies reproduce single-process training step by step (fp32, same data, same seed).

Each name on 2 ranks (hsdp on 4: 2 replicas x 2 shards) with the global batch fixed at 8: plain, with
gradient accumulation, and with activation checkpointing; clipping by the global norm; mixed precision.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import relative_difference, train_tiny_gpt

from lightscale.strategies import FSDP2Strategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # relative, per step (measured ~1.5e-7: fp32 reassociation of the gradient sums)
GLOBAL_BATCH = 8
NAMES = ["fsdp2", "fsdp2_grad_op", "hsdp", "fsdp2_offload"]
RANKS = {"hsdp": 4}


def _strategy(name: str, **overrides: Any) -> FSDP2Strategy:
    return FSDP2Strategy(**{**FSDP2Strategy.aliases[name][1], **overrides})


def _train(strategy: Any, ranks: int, cache_dir: str, *, accumulate: int = 1, **kwargs: Any) -> list[float]:
    per_rank = run_distributed(
        train_tiny_gpt,
        strategy,
        devices=ranks,
        batch_size=GLOBAL_BATCH // ranks // accumulate,
        accumulate=accumulate,
        cache_dir=cache_dir,
        world_size=ranks,
        timeout_s=600,
        **kwargs,
    )
    assert all(losses == per_rank[0] for losses in per_rank)  # every rank logs the same global loss
    return per_rank[0]


@pytest.fixture(scope="module")
def single_process_losses(corpus_cache: str) -> list[float]:
    return _train("auto", 1, corpus_cache)


@pytest.mark.parametrize("name", NAMES)
def test_matches_single_process(name: str, single_process_losses: list[float], corpus_cache: str) -> None:
    losses = _train(name, RANKS.get(name, 2), corpus_cache)
    assert len(losses) == 20
    assert relative_difference(losses, single_process_losses) <= TOLERANCE
    assert single_process_losses[-1] < single_process_losses[0] - 0.5  # it learned: the comparison is not vacuous


@pytest.mark.parametrize("name", NAMES)
def test_gradient_accumulation_matches(name: str, single_process_losses: list[float], corpus_cache: str) -> None:
    losses = _train(name, RANKS.get(name, 2), corpus_cache, accumulate=2)
    assert relative_difference(losses, single_process_losses) <= TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_full_activation_checkpointing_matches(
    name: str, single_process_losses: list[float], corpus_cache: str
) -> None:
    strategy = _strategy(name, activation_checkpointing="full")
    losses = _train(strategy, RANKS.get(name, 2), corpus_cache)
    assert relative_difference(losses, single_process_losses) <= TOLERANCE


def test_selective_activation_checkpointing_with_accumulation_matches(
    single_process_losses: list[float], corpus_cache: str
) -> None:
    strategy = _strategy("fsdp2", activation_checkpointing="selective")
    losses = _train(strategy, 2, corpus_cache, accumulate=2)
    assert relative_difference(losses, single_process_losses) <= TOLERANCE


@pytest.mark.parametrize("name", ["fsdp2", "hsdp"])
def test_gradient_clipping_uses_the_global_norm(
    name: str, single_process_losses: list[float], corpus_cache: str
) -> None:
    clipped = _train("auto", 1, corpus_cache, gradient_clip_val=0.05)
    # AdamW is nearly invariant to gradient scale, so clipping moves losses little, but far beyond TOLERANCE.
    assert relative_difference(clipped, single_process_losses) > 50 * TOLERANCE  # the clip is active
    losses = _train(name, RANKS.get(name, 2), corpus_cache, gradient_clip_val=0.05)
    assert relative_difference(losses, clipped) <= TOLERANCE


def test_bf16_mixed_trains_close_to_fp32(single_process_losses: list[float], corpus_cache: str) -> None:
    losses = _train("fsdp2", 2, corpus_cache, precision="bf16-mixed")
    # bf16 compute (8-bit mantissa) with fp32 master weights and reduction: close to fp32, not equal.
    assert relative_difference(losses, single_process_losses) <= 2e-2


def test_fp16_mixed_trains_with_a_sharded_loss_scaler(single_process_losses: list[float], corpus_cache: str) -> None:
    losses = _train("fsdp2", 2, corpus_cache, precision="16-mixed")
    assert relative_difference(losses, single_process_losses) <= 2e-2


def test_model_built_on_every_rank_without_meta_init_matches(
    single_process_losses: list[float], corpus_cache: str
) -> None:
    losses = _train(FSDP2Strategy(meta_init=False), 2, corpus_cache)
    assert relative_difference(losses, single_process_losses) <= TOLERANCE
