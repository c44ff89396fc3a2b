"""A scheduler rebound to the optimizer the ZeRO strategy swaps in steps without torch's order warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightscale.optim.install import rebind_scheduler


def _swap(rebind: bool) -> list[str]:
    weight = torch.nn.Parameter(torch.ones(2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([weight], lr=1.0), lambda step: 0.5**step)
    host = torch.optim.SGD([weight], lr=1.0)  # what offload does: another optimizer over the same parameters
    if rebind:
        rebind_scheduler(scheduler, host)
    else:
        scheduler.optimizer = host  # what zero.py did before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            weight.grad = torch.ones(2)
            host.step()
            scheduler.step()
    assert host.param_groups[0]["lr"] == 0.25  # the schedule drives the optimizer that steps
    return [str(w.message) for w in caught]


def test_rebound_scheduler_warns_nothing() -> None:
    assert _swap(rebind=True) == []


def test_plain_assignment_warns() -> None:
    assert any("has been overridden after learning rate scheduler" in m for m in _swap(rebind=False))


@pytest.mark.parametrize("times", [1, 2])
def test_rebinding_is_idempotent(times: int) -> None:
    weight = torch.nn.Parameter(torch.ones(1))
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([weight], lr=1.0), step_size=1)
    host = torch.optim.SGD([weight], lr=1.0)
    for _ in range(times):
        rebind_scheduler(scheduler, host)
    weight.grad = torch.ones(1)
    host.step()
    assert host._opt_called and host.step._wrapped_by_lr_sched  # type: ignore[attr-defined]
