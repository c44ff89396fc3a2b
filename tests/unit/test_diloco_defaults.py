"""DiLoCo's outer step defaults by H: what the strategy and OuterSync build when the user leaves them out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightscale.parallel.diloco import OuterSync, default_outer_step
from lightscale.parallel.diloco.outer_settings import OUTER_STEP_BY_H, PAPER_OUTER_STEP
from lightscale.strategies import DiLoCoStrategy


def _outer_sgd(sync: OuterSync) -> dict:
    optimizer = sync.fragments[0].optimizer
    assert isinstance(optimizer, torch.optim.SGD)
    return optimizer.param_groups[0]


@pytest.mark.parametrize("sync_every", [1, 10, 30, 100, 200, 500])
def test_strategy_takes_the_default_for_its_h(sync_every: int) -> None:
    strategy = DiLoCoStrategy(sync_every=sync_every)
    assert (strategy.outer_lr, strategy.outer_momentum) == default_outer_step(sync_every)
    assert strategy.outer_step_defaulted


def test_the_table_covers_h_in_order_and_the_paper_beyond() -> None:
    largest = [h for h, _, _ in OUTER_STEP_BY_H]
    assert largest == sorted(largest)
    for h, lr, momentum in OUTER_STEP_BY_H:
        assert default_outer_step(h) == (lr, momentum)
    assert default_outer_step(largest[-1] + 1) == PAPER_OUTER_STEP


def test_given_values_are_kept_and_a_missing_one_is_filled() -> None:
    given = DiLoCoStrategy(sync_every=30, outer_lr=0.9, outer_momentum=0.8)
    assert (given.outer_lr, given.outer_momentum, given.outer_step_defaulted) == (0.9, 0.8, False)
    lr_only = DiLoCoStrategy(sync_every=30, outer_lr=0.9)
    assert (lr_only.outer_lr, lr_only.outer_momentum) == (0.9, default_outer_step(30)[1])


@pytest.mark.parametrize("sync_every", [10, 100, 1000])
def test_outer_sync_builds_nesterov_sgd_with_the_default(sync_every: int) -> None:
    sync = OuterSync(nn.Linear(3, 2).named_parameters(), sync_every=sync_every, reduce=lambda payload: payload)
    group = _outer_sgd(sync)
    lr, momentum = default_outer_step(sync_every)
    assert (group["lr"], group["momentum"], group["nesterov"]) == (lr, momentum, momentum > 0)
