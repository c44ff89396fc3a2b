"""The memory-chosen strategy's table: for the tiny GPT on 2 ranks, each budget picks the least-communication
candidate whose estimate fits; ``lightscale plan`` prints the same table."""

from __future__ import annotations

import pytest
from helpers import TINY

from lightscale.cli import main
from lightscale.estimate.plan import choose, plan
from lightscale.recipes.gpt import GPTModule
from lightscale.strategies.registry import plan_candidates

# Device bytes per rank -> (strategy, activation checkpointing) chosen; micro-batch 2, fp32, AdamW, 2 ranks.
BUDGETS = [
    (900_000, ("bucketed_ddp", "none")),
    (850_000, ("zero1", "none")),
    (800_000, ("zero2", "none")),
    (700_000, ("fsdp2", "none")),
    (500_000, ("fsdp2", "full")),
    (200_000, ("fsdp2_offload", "full")),
    (50_000, None),
]


@pytest.mark.parametrize(("budget", "expected"), BUDGETS)
def test_budget_picks_the_least_communication_that_fits(budget: int, expected: tuple[str, str] | None) -> None:
    chosen = choose(plan(GPTModule(TINY), plan_candidates(), world_size=2, budget=budget, micro_batch=2))
    assert (None if chosen is None else (chosen.strategy, chosen.activation_checkpointing)) == expected


def test_plan_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(["plan", "--config", "gpt/small_ddp.yaml", "--device-memory", "150MiB"])
    out = capsys.readouterr().out
    assert "bucketed_ddp" in out and "fsdp2_offload" in out
    assert "chose fsdp2: the least communication that fits" in out
