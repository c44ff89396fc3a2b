"""Every registered strategy name reproduces single-process training step by step, with plain SGD.

Plain SGD (no momentum, constant rate) makes the comparison see gradient scale: a gradient averaged over the wrong
number of ranks or micro-batches is a step of the wrong size, which moves the losses by orders of magnitude more
than the tolerance (``test_a_planted_scale_error_fails`` shows it). AdamW would cancel such a factor.

Each rank's own loss (before any reduction) is compared: data-parallel ranks see different batches, so their
mean must equal the single-process loss of the whole batch.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import pytest
from helpers import PARITY_TOLERANCE, SGD_LR, TINY, relative_difference, train_tiny_gpt

import lightscale
from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy, Parallel3DStrategy, ZeroStrategy
from lightscale.testing import run_distributed

TOLERANCE = PARITY_TOLERANCE  # relative, per step, fp32 (measured ~1e-7: reassociation of the gradient sums)
STEPS = 10
GLOBAL_BATCH = 8
PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)  # stages hold whole layers; no tied head
RANKS = {"hsdp": 4, "tp2_pp2": 4, "cp2_tp2": 4}
DATA_PARALLEL = {"tp2": 1, "pp2": 1, "tp2_pp2": 1, "cp2": 1, "cp2_tp2": 1}  # the rest of the ranks are data parallel
# Names whose gradients are approximate by design (relative loss bounds over the 10 plain-SGD steps; derivations):
# - bf16 on the wire: each gradient element rounded to 8 bits at most twice (the cast, the 2-rank bf16 sum), round to
#   nearest even on any CPU: relative error <= 2 * 2**-9 = 3.9e-3 in every step. To first order each step's loss change
#   errs by that fraction of itself, so the loss by <= 3.9e-3 * sum_k |L(k+1) - L(k)| / min L = 3.9e-3 * 0.83 = 3.2e-3
#   (tests/assets/losses/gpt_tiny_sgd.json: 5.49 -> 3.64 with one rise); 2e-2 leaves 6x for second-order terms.
# - PowerSGD: rank-4 factors with error feedback, fp32 throughout: its error is a function of the gradients, which the
#   machine's rounding moves by ~1e-7 relative, not of luck; measured 7.4e-3, bound 2.7x (exact properties:
#   tests/distributed/test_powersgd.py).
# - ZeRO++: int8 weights and gradients rounded stochastically, each value within one step, absmax/127, of its block:
#   an error no larger than 1/127 of the block's largest value, so (first order) the loss within 1/127 of itself
#   (exact properties: tests/distributed/test_zeropp.py).
APPROXIMATE = {"bucketed_ddp_bf16": 2e-2, "bucketed_ddp_powersgd": 2e-2, "fsdp2_zeropp": 1 / 127}
# MoE names: test_moe.py; DiLoCo's workers train alone between syncs: test_diloco.py (exact at H=1).
NAMES = [
    name
    for name, _ in lightscale.strategy_table()
    if not name.startswith("ep") and name not in {"diloco", "streaming_diloco", "local_sgd"}
]


def _async_io_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _config(name: str) -> Any:
    return PIPELINED if name.startswith(("pp2", "tp2_pp2")) else TINY


def _reference(cache_dir: str, config: Any = TINY, clip: float | None = None) -> list[float]:
    return list(_cached_reference(cache_dir, config is PIPELINED, clip))


@cache
def _cached_reference(cache_dir: str, pipelined: bool, clip: float | None) -> tuple[float, ...]:
    """One process, the whole global batch at once: accumulation and data parallelism must both reproduce it."""
    losses = run_distributed(
        train_tiny_gpt,
        "auto",
        devices=1,
        batch_size=GLOBAL_BATCH,
        max_steps=STEPS,
        config=PIPELINED if pipelined else TINY,
        cache_dir=cache_dir,
        gradient_clip_val=clip,
        sgd_lr=SGD_LR,
        world_size=1,
    )[0]
    return tuple(losses)


def _train(
    strategy: Any, ranks: int, dp: int, cache_dir: str, *, config: Any = TINY, accumulate: int = 1, **kwargs: Any
) -> list[float]:
    """Mean over ranks of each rank's own step losses (ranks sharing a batch under TP/PP hold the same loss)."""
    per_rank = run_distributed(
        train_tiny_gpt,
        strategy,
        devices=ranks,
        batch_size=GLOBAL_BATCH // dp // accumulate,
        accumulate=accumulate,
        max_steps=STEPS,
        config=config,
        cache_dir=cache_dir,
        sgd_lr=SGD_LR,
        local_losses=True,
        world_size=ranks,
        timeout_s=900,
        **kwargs,
    )
    assert all(len(losses) == STEPS for losses in per_rank)
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


def _named(name: str, tmp_path: Any) -> tuple[Any, dict[str, Any]]:
    """The strategy for ``name`` (ZeRO offload steps SGD with torch's own implementation on the host) and extra
    Trainer arguments."""
    if name in ZeroStrategy.aliases:
        return ZeroStrategy(**ZeroStrategy.aliases[name][1]), {"default_root_dir": str(tmp_path)}
    return name, {}


@pytest.mark.parametrize("name", NAMES)
def test_every_name_matches_single_process_sgd(name: str, corpus_cache: str, tmp_path: Any) -> None:
    if name == "zero_infinity" and not _async_io_available():
        pytest.skip("zero_infinity needs libaio (apt-get install libaio-dev)")
    ranks = RANKS.get(name, 2)
    strategy, extra = _named(name, tmp_path)
    config = _config(name)
    losses = _train(strategy, ranks, DATA_PARALLEL.get(name, ranks), corpus_cache, config=config, **extra)
    reference = _reference(corpus_cache, config)
    tolerance = APPROXIMATE.get(name, TOLERANCE)
    assert relative_difference(losses, reference) <= tolerance
    assert reference[-1] < reference[0] - 1.0  # it learned: the comparison is not vacuous


@pytest.mark.parametrize("name", ["bucketed_ddp", "zero2", "fsdp2", "pp2"])
def test_gradient_accumulation_matches(name: str, corpus_cache: str, tmp_path: Any) -> None:
    strategy, extra = _named(name, tmp_path)
    config = _config(name)
    dp = DATA_PARALLEL.get(name, 2)
    losses = _train(strategy, 2, dp, corpus_cache, config=config, accumulate=2, **extra)
    assert relative_difference(losses, _reference(corpus_cache, config)) <= TOLERANCE


@pytest.mark.parametrize("name", ["zero2", "fsdp2", "hsdp", "tp2_pp2"])
def test_clipping_uses_the_global_norm(name: str, corpus_cache: str, tmp_path: Any) -> None:
    # With SGD a clipped step is a shorter step: a norm taken over one shard or one stage would clip differently.
    config = _config(name)
    clipped = _reference(corpus_cache, config, clip=CLIP)
    assert relative_difference(clipped, _reference(corpus_cache, config)) > 100 * TOLERANCE  # the clip is active
    strategy, extra = _named(name, tmp_path)
    ranks = RANKS.get(name, 2)
    losses = _train(strategy, ranks, DATA_PARALLEL.get(name, ranks), corpus_cache, config=config, **extra, **CLIPPING)
    assert relative_difference(losses, clipped) <= TOLERANCE


CLIP = 0.5  # below the tiny GPT's gradient norm on most steps
CLIPPING = {"gradient_clip_val": CLIP}


# ---- the tests above can fail: plant a wrong gradient scale and watch the comparison break -------------------
class SummingDDP(BucketedDDPStrategy):
    """bucketed_ddp with the 1/world factor forgotten: gradients are summed over ranks, not averaged."""

    def apply_parallelism(self, module: Any) -> Any:
        wrapped = super().apply_parallelism(module)
        assert self.reducer is not None
        self.reducer._scale = 1.0
        return wrapped


class SummedMicrobatches(Parallel3DStrategy):
    """pp2 whose schedule sums the microbatches' gradients instead of averaging them."""

    def apply_parallelism(self, module: Any) -> Any:
        wrapped = super().apply_parallelism(module)
        assert self.pipeline is not None
        self.pipeline.schedule.scale_grads = False
        return wrapped


class UnscaledAccumulation(FSDP2Strategy):
    """fsdp2 that forgets Lightning's 1/accumulate_grad_batches on each micro-batch loss."""

    def backward(self, closure_loss: Any, *args: Any, **kwargs: Any) -> Any:
        return super().backward(closure_loss * self.lightning_module.trainer.accumulate_grad_batches, *args, **kwargs)


@pytest.mark.parametrize(
    ("strategy", "accumulate"),
    [(SummingDDP(), 1), (UnscaledAccumulation(), 2), (SummedMicrobatches(pp=2), 1)],
    ids=["ddp-sum-over-ranks", "fsdp2-accumulation-unscaled", "pp2-microbatches-summed"],
)
def test_a_planted_scale_error_fails(strategy: Any, accumulate: int, corpus_cache: str) -> None:
    pipelined = isinstance(strategy, Parallel3DStrategy)
    config = PIPELINED if pipelined else TINY
    losses = _train(strategy, 2, 1 if pipelined else 2, corpus_cache, config=config, accumulate=accumulate)
    assert relative_difference(losses, _reference(corpus_cache, config)) > 1000 * TOLERANCE


@pytest.mark.parametrize("name", ["fsdp2", "hsdp"])
def test_meta_device_init_is_rank_zeros_whatever_each_rank_seeds(name: str, corpus_cache: str) -> None:
    # The GPT is built on the meta device and materialized shard by shard: every rank must replay rank 0's generator.
    ranks = RANKS.get(name, 2)
    losses = _train(name, ranks, ranks, corpus_cache, seed_per_rank=True)
    assert relative_difference(losses, _reference(corpus_cache)) <= TOLERANCE
