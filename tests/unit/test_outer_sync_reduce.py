"""OuterSync's reduce hook (what fault-tolerant DiLoCo plugs torchft into), in one process: no process group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightscale.errors import ConfigurationError
from lightscale.parallel.diloco import OuterSync


def _sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


def test_the_reducer_mean_is_applied_and_a_dropped_round_returns_to_the_global_parameters() -> None:
    model = nn.Linear(3, 2)
    start = [p.detach().clone() for p in model.parameters()]
    answers: list[torch.Tensor | None] = [None]
    sync = OuterSync(model.named_parameters(), sync_every=1, outer_optimizer=_sgd, reduce=lambda _: answers[-1])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sync.after_inner_step(1)  # dropped: back to the start, no outer step
    for p, s in zip(model.parameters(), start, strict=True):
        assert torch.equal(p, s)
    answers.append(torch.full((8,), -0.5))  # the workers' mean pseudo-gradient global - local
    sync.after_inner_step(2)
    for p, s in zip(model.parameters(), start, strict=True):
        torch.testing.assert_close(p, s + 0.5)


@pytest.mark.parametrize("kwargs", [{"compression": "bf16"}, {"overlap_steps": 1}])
def test_a_reducer_needs_fp32_and_no_overlap(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match="compression='none' and overlap_steps=0"):
        OuterSync(nn.Linear(2, 2).named_parameters(), sync_every=2, reduce=lambda p: p, **kwargs)
