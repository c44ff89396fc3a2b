"""``strategy="fit_memory"`` becomes the strategy the plan chose for its budget (the rows of tests/unit/test_plan.py
that train on CPU), trains, and the measured memory (MemoryProfiler's tracked states and activations per rank)
stays under that budget. The Trainer holds the chosen strategy object from the first hook on; the ``FitMemoryStrategy``
the user made stays one (its class is never swapped) and names the choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import train_tiny_gpt
from lightning.pytorch import Callback

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


class _StrategyAtSetup(Callback):
    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[no-untyped-def]
        self.strategy = trainer.strategy


def _fit(budget: int, cache_dir: str, out_dir: str) -> tuple[str, str, float]:
    strategy = FitMemoryStrategy(memory_budget=budget, check_batches_every=7)
    profiler = MemoryProfiler(every_n_steps=1, out_dir=out_dir, plot=False)
    at_setup = _StrategyAtSetup()
    train_tiny_gpt(
        strategy, devices=2, batch_size=2, max_steps=2, cache_dir=cache_dir, extra_callbacks=[profiler, at_setup]
    )
    chosen = strategy.chosen
    assert type(strategy) is FitMemoryStrategy and at_setup.strategy is chosen  # no class swap: another object
    assert chosen.check_batches_every == 7 and chosen.launcher is strategy.launcher  # the user's setting, the launcher
    checkpointing = getattr(chosen, "activation_checkpointing", "none")
    return type(chosen).__name__, checkpointing, max(record["peak"] for record in profiler.records)


@pytest.mark.parametrize(("budget", "expected"), RUNS)
def test_chosen_strategy_trains_under_its_budget(
    budget: int, expected: tuple[str, str], corpus_cache: str, tmp_path: Path
) -> None:
    results = run_distributed(_fit, budget, corpus_cache, str(tmp_path), world_size=2, timeout_s=300)
    for name, checkpointing, peak in results:
        assert (name, checkpointing) == expected
        assert peak <= budget
