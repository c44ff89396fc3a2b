"""CombinedOptimizer in one process: Muon + AdamW stepped as one equal the two stepped by hand, bitwise; its state
dict (torch's format, both parts) resumes bitwise; an LR scheduler on it schedules every part's groups."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightscale.optim import CombinedOptimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _parts(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


def _train(model: nn.Module, step: object, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    for _ in range(steps):
        nn.functional.cross_entropy(model(x), y).backward()
        step()


def test_equals_the_parts_stepped_by_hand_and_resumes_bitwise() -> None:
    by_hand = _model()
    parts = _parts(by_hand)
    _train(by_hand, lambda: [(p.step(), p.zero_grad()) for p in parts], 5)

    combined_model = _model()
    combined = CombinedOptimizer(_parts(combined_model))
    _train(combined_model, lambda: (combined.step(), combined.zero_grad()), 3)
    saved = copy.deepcopy(combined.state_dict())
    resumed_model = _model()
    resumed_model.load_state_dict(combined_model.state_dict())
    resumed = CombinedOptimizer(_parts(resumed_model))
    resumed.load_state_dict(saved)
    _train(combined_model, lambda: (combined.step(), combined.zero_grad()), 2)
    _train(resumed_model, lambda: (resumed.step(), resumed.zero_grad()), 2)

    for a, b, c in zip(by_hand.parameters(), combined_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert [group["params"] for group in saved["param_groups"]] == [[0, 1], [2, 3]]
    assert [set(saved["state"][i]) for i in range(4)] == [{"momentum_buffer"}] * 2 + [
        {"step", "exp_avg", "exp_avg_sq"}
    ] * 2


def test_a_scheduler_schedules_every_part() -> None:
    combined = CombinedOptimizer(_parts(_model()))
    scheduler = torch.optim.lr_scheduler.StepLR(combined, step_size=1, gamma=0.5)
    combined.step()
    scheduler.step()
    assert [part.param_groups[0]["lr"] for part in combined.optimizers] == [0.01, 1.5e-3]


def test_a_parameter_in_two_parts_is_refused() -> None:
    weight = nn.Parameter(torch.ones(2, 2))
    with pytest.raises(ValueError, match="a parameter is in two of its optimizers"):
        CombinedOptimizer([torch.optim.SGD([weight], lr=0.1), torch.optim.AdamW([weight])])


def test_state_view_follows_state_an_engine_keyed_by_other_tensors() -> None:
    """DeepSpeed replaces the groups' tensors with flat partitions and keys the state by those: the combined state
    view still iterates and reads it (Lightning's teardown moves every state tensor)."""
    combined = CombinedOptimizer(_parts(_model()))
    flat = torch.zeros(3)
    combined.optimizers[1].state[flat] = {"exp_avg": torch.ones(3)}
    assert combined.state[flat]["exp_avg"].sum() == 3 and flat in dict(combined.state.items())


def test_a_narrowed_param_groups_steps_only_that_group() -> None:
    """DeepSpeed's ZeRO steps the optimizer with ``param_groups`` narrowed to one group: only that group's part
    steps, on that group alone, and the parts keep all their groups afterwards."""
    model = _model()
    muon, adamw = _parts(model)
    adamw.add_param_group({"params": [nn.Parameter(torch.ones(3))], "lr": 0.1})
    combined = CombinedOptimizer([muon, adamw])
    for p in (p for group in combined.param_groups for p in group["params"]):
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for group in combined.param_groups for p in group["params"]]
    everything = combined.param_groups
    combined.param_groups = [everything[1]]  # AdamW's first group
    combined.step()
    combined.param_groups = everything
    after = [p.detach() for group in combined.param_groups for p in group["params"]]
    changed = [not torch.equal(a, b) for a, b in zip(before, after, strict=True)]
    assert changed == [False, False, True, True, False]  # the two matrices, the two biases, the extra vector
    assert len(adamw.param_groups) == 2 and combined.param_groups == [*muon.param_groups, *adamw.param_groups]
