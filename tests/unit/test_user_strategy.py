"""A strategy subclass defined in a user's own file is known everywhere once its class is defined: Lightning's
registry, ``lightscale strategies``, the estimator, the planner and the precision contract (no lightscale file
edited). The class is defined in a fixture and unregistered after, so no other test sees it."""

from __future__ import annotations

from collections.abc import Iterator

import lightning
import pytest
from helpers import TINY

from lightscale.cli import main
from lightscale.estimate import estimate_memory, layout_of
from lightscale.estimate.plan import Plannable, plan
from lightscale.plugins.precision_contract import render_table
from lightscale.recipes.gpt import GPTModule
from lightscale.strategies import BucketedDDPStrategy
from lightscale.strategies.registry import (
    family_members,
    plan_candidates,
    strategy_classes,
    strategy_table,
    unregister_strategy,
)

NAME = "tiny_bucket_ddp"


@pytest.fixture(scope="module")
def user_strategy() -> Iterator[type[BucketedDDPStrategy]]:
    class TinyBucketDDP(BucketedDDPStrategy):
        """bucketed_ddp with 1 MiB buckets, as a user would write it in their own file."""

        aliases = {NAME: ("bucketed_ddp with 1 MiB buckets (a user's strategy)", {"bucket_cap_mb": 1.0})}
        plannable = (Plannable(NAME, "2Ψ", "replicated states, 1 MiB buckets"),)

    yield TinyBucketDDP
    unregister_strategy(TinyBucketDDP)
    assert NAME not in lightning.pytorch.strategies.StrategyRegistry and TinyBucketDDP not in strategy_classes()


def test_lightning_trainer_resolves_the_name(user_strategy: type[BucketedDDPStrategy]) -> None:
    trainer = lightning.Trainer(strategy=NAME, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is user_strategy and trainer.strategy.bucket_cap_mb == 1.0


def test_listed_by_lightscale_strategies(
    user_strategy: type[BucketedDDPStrategy], capsys: pytest.CaptureFixture[str]
) -> None:
    main(["strategies"])
    assert NAME in capsys.readouterr().out
    assert strategy_table()[-1][0] == NAME  # after the built-in names; the parent's names are not repeated
    assert [name for name, _ in strategy_table()].count("bucketed_ddp") == 1


def test_estimated_by_name_like_its_parent(user_strategy: type[BucketedDDPStrategy]) -> None:
    assert layout_of(NAME, world_size=4) == layout_of("bucketed_ddp", world_size=4).with_(name=NAME)
    ours = estimate_memory(GPTModule(TINY), NAME, world_size=2, micro_batch=2)
    parent = estimate_memory(GPTModule(TINY), "bucketed_ddp", world_size=2, micro_batch=2)
    assert ours.strategy == NAME and ours.device_total == parent.device_total


def test_planned_when_declared_plannable(user_strategy: type[BucketedDDPStrategy]) -> None:
    assert plan_candidates()[-1].strategy == NAME
    assert [option.strategy for option in plan_candidates()].count("bucketed_ddp") == 1  # not inherited
    rows = plan(GPTModule(TINY), plan_candidates(), world_size=2, budget=900_000, micro_batch=2)
    assert rows[-1].strategy == NAME and rows[-1].fits


def test_member_of_its_parents_precision_family(user_strategy: type[BucketedDDPStrategy]) -> None:
    rules = BucketedDDPStrategy.precision_rules
    assert user_strategy.precision_rules is rules and rules is not None and rules.family == "bucketed_ddp"
    diloco = ["diloco", "streaming_diloco", "local_sgd"]  # bucketed_ddp inside each worker by default
    assert family_members()[rules] == [
        "bucketed_ddp",
        "bucketed_ddp_bf16",
        "bucketed_ddp_powersgd",
        *diloco,
        NAME,
    ]
    listed = ", ".join(f"`{name}`" for name in family_members()[rules])
    assert f"| bucketed_ddp | {listed} |" in render_table(family_members())
