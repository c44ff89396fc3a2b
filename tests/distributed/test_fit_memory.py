"""``strategy="fit_memory"`` becomes the strategy the plan chose for its budget (the rows of tests/unit/test_plan.py
that train on CPU), trains, and the measured memory (MemoryProfiler's tracked states and activations per rank)
stays under that budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import train_tiny_gpt

from lightscale.callbacks import MemoryProfiler
from lightscale.strategies import FitMemoryStrategy
from lightscale.testing import run_distributed

# Device bytes per rank -> (strategy class, activation checkpointing); tiny GPT, micro-batch 2, fp32, 2 ranks.
RUNS = [
    (900_000, ("BucketedDDPStrategy", "none")),
    (800_000, ("ZeroStrategy", "none")),
    (700_000, ("FSDP2Strategy", "none")),
    (500_000, ("FSDP2Strategy", "full")),
]


def _fit(budget: int, cache_dir: str, out_dir: str) -> tuple[str, str, float]:
    strategy = FitMemoryStrategy(memory_budget=budget)
    profiler = MemoryProfiler(every_n_steps=1, out_dir=out_dir, plot=False)
    train_tiny_gpt(strategy, devices=2, batch_size=2, max_steps=2, cache_dir=cache_dir, extra_callbacks=[profiler])
    checkpointing = getattr(strategy, "activation_checkpointing", "none")
    return type(strategy).__name__, checkpointing, max(record["peak"] for record in profiler.records)


@pytest.mark.parametrize(("budget", "expected"), RUNS)
def test_chosen_strategy_trains_under_its_budget(
    budget: int, expected: tuple[str, str], corpus_cache: str, tmp_path: Path
) -> None:
    results = run_distributed(_fit, budget, corpus_cache, str(tmp_path), world_size=2, timeout_s=300)
    for name, checkpointing, peak in results:
        assert (name, checkpointing) == expected
        assert peak <= budget
