"""The memory-chosen strategy's table: for the tiny GPT on 2 ranks, each budget picks the least-communication
candidate whose estimate fits; ``lightscale plan`` prints the same table."""

from __future__ import annotations

import dataclasses

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


def test_plan_proposes_context_parallelism_when_activations_do_not_fit() -> None:
    # 4096 tokens: activations dominate. Offloading model states does not make them fit; cp2 halves them (each rank
    # holds half of every sequence), so the estimate of its activations is half of fsdp2's with the same recompute.
    long = dataclasses.replace(TINY, block_size=4096)
    rows = plan(GPTModule(long), plan_candidates(), world_size=2, budget=5 * 2**20, micro_batch=1)
    by_name = {(row.strategy, row.activation_checkpointing): row for row in rows}
    chosen = choose(rows)
    assert chosen is not None and chosen.strategy == "cp2" and not by_name["fsdp2_offload", "full"].fits
    cp2, fsdp2 = by_name["cp2", "full"].estimate, by_name["fsdp2", "full"].estimate
    assert cp2.activations.device == pytest.approx(fsdp2.activations.device / 2, rel=1e-6)
    assert cp2.model_states == pytest.approx(fsdp2.model_states, rel=1e-6)  # FSDP2 over dp x cp: the same shards


def test_plan_without_deepspeed_shows_zero_as_needing_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The estimator reads ZeRO's layout from its class (no instance, no DeepSpeed import): the rows stay, marked,
    and the planner chooses the next candidate that fits."""
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importlib now finds no DeepSpeed; importing it would fail
    candidates = plan(GPTModule(TINY), plan_candidates(), world_size=2, budget=850_000, micro_batch=2)
    zero = [c for c in candidates if c.strategy.startswith("zero")]
    assert zero and all(c.missing == "deepspeed" and not c.fits for c in zero)
    assert choose(candidates).strategy == "fsdp2"  # zero1 and zero2 would fit this budget (BUDGETS above)
    main(["plan", "--config", "gpt/tiny_ddp.yaml", "--world-size", "8"])
    assert "(needs the [deepspeed] extra)" in capsys.readouterr().out
    assert sys.modules["deepspeed"] is None
