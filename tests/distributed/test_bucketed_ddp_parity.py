"""bucketed_ddp with many small buckets still reproduces single-process SGD training step by step (fp32).

The registered names' parity, accumulation and the planted-error check live in test_parity.py; this file covers
what only the reducer has: buckets launched in order while backward runs, many at a time.
"""

from __future__ import annotations

from helpers import SGD_LR, relative_difference, train_tiny_gpt

from lightscale.strategies import BucketedDDPStrategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-5  # relative, per step; fp32 reassociation of the gradient sum stays far below this
GLOBAL_BATCH = 8


def test_many_small_buckets_match_single_process(corpus_cache: str) -> None:
    common = {"cache_dir": corpus_cache, "max_steps": 10, "sgd_lr": SGD_LR}
    reference = run_distributed(train_tiny_gpt, "auto", devices=1, batch_size=GLOBAL_BATCH, world_size=1, **common)[0]
    strategy = BucketedDDPStrategy(bucket_cap_mb=0.01, first_bucket_cap_mb=0.005)
    per_rank = run_distributed(
        train_tiny_gpt, strategy, devices=2, batch_size=GLOBAL_BATCH // 2, local_losses=True, world_size=2, **common
    )
    losses = [(a + b) / 2 for a, b in zip(*per_rank, strict=True)]
    assert relative_difference(losses, reference) <= TOLERANCE
