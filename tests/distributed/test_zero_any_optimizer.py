"""Any torch optimizer under every ZeRO name: SGD with momentum (state created at the first step) and Adagrad (state
created at construction), on a small classifier a user might bring, 2 gloo ranks, fp32.

One launch runs everything: for each name and optimizer, a run of ``STEPS`` steps that saves at ``SAVE_AT`` and a run
that resumes that checkpoint; then an SGD-with-momentum checkpoint carried zero2 -> fsdp2 -> bucketed_ddp -> zero2
(tests/checkpoint_matrix.py's legs). The tests below check
    * parity: the losses equal one process with the same optimizer on the same global batch;
    * resume: the checkpoint holds the optimizer's own state (momentum buffers, Adagrad's sums and step), the resumed
      engine holds the saved state bitwise, and the next losses and the final state equal the uninterrupted run's;
    * the SGD checkpoint moves between ZeRO, FSDP2 and DDP with its momentum buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from checkpoint_matrix import (
    Leg,
    LegResult,
    Member,
    check_loaded,
    merge_ranks,
    read_offline,
    run_legs,
    same,
    torch_live_state,
    zero_live_state,
    zero_member,
)
from helpers import StepLosses, quiet_trainer, relative_difference
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.strategies import BucketedDDPStrategy, FSDP2Strategy
from lightscale.testing import run_distributed

TOLERANCE = 1e-6  # relative, per step: one process vs two ranks differ only in the order of the gradient sums
STEPS, SAVE_AT = 5, 2
GLOBAL_BATCH = 8
NAMES = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.03),
}
STATE_KEYS = {"sgd_momentum": {"momentum_buffer"}, "adagrad": {"sum", "step"}}
CASES = [(name, optimizer) for name in NAMES for optimizer in OPTIMIZERS]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Classifier(pl.LightningModule):
    """Residual blocks in a ``ModuleList`` and the optimizer named ``optimizer``."""

    def __init__(self, optimizer: str, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)


class ClassifierWorkload:
    """One fixed global batch every step (the ranks split it): the data position cannot matter after a resume."""

    def __init__(self, optimizer: str) -> None:
        self.optimizer = optimizer

    def fit(
        self, strategy: Any, *, batch_size: int, callbacks: list, max_steps: int, resume_from: str | None, **_: Any
    ) -> list[float]:
        pl.seed_everything(0, verbose=False)
        losses = StepLosses()
        callbacks = [losses, *callbacks, _FinalState(max_steps)]
        trainer = quiet_trainer(strategy, devices=dist.get_world_size(), max_steps=max_steps, callbacks=callbacks)
        trainer.fit(
            Classifier(self.optimizer),
            DataLoader(TensorDataset(*_batch()), batch_size=batch_size),
            ckpt_path=resume_from,
        )
        return losses.steps

    def state_names(self) -> set[str]:
        return set(Classifier(self.optimizer).state_dict())


FINAL: list[dict[str, torch.Tensor] | None] = []  # per fit on this rank: the live tensors after its last step


class _FinalState(pl.Callback):
    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        FINAL.append(None)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.max_steps:
            live = zero_live_state if hasattr(trainer.strategy, "engine") else torch_live_state
            FINAL[-1] = _tensors(live(trainer))


def single_process_losses(optimizer: str) -> list[float]:
    """The reference: one process, the whole batch, the same initial weights and optimizer."""
    torch.manual_seed(0)
    module = Classifier(optimizer)
    step = module.configure_optimizers()
    losses = []
    for _ in range(STEPS):
        loss = module.training_step(_batch(), 0)
        loss.backward()
        step.step()
        step.zero_grad()
        losses.append(loss.item())
    return losses


# ---- the one launch ---------------------------------------------------------------------------------------------
def _zero_legs(root: Path) -> list[Leg]:
    """Per name and optimizer: the uninterrupted run (saves at SAVE_AT), then the run resuming its checkpoint."""
    legs = []
    for name, optimizer in CASES:
        member = zero_member(name, 2, **_zero_options(name))
        path = str(root / f"{name}_{optimizer}")
        workload = ClassifierWorkload(optimizer)
        legs.append(Leg(member, None, path, STEPS, STEPS, save_at=SAVE_AT, workload=workload))
        legs.append(Leg(member, path, path + "_resumed", STEPS, STEPS, workload=workload))
    return legs


def _zero_options(name: str) -> dict[str, Any]:
    from lightscale.strategies import ZeroStrategy

    return dict(ZeroStrategy.aliases[name][1])


CROSS_END = 8  # zero2 saves at 2, fsdp2 at 4, bucketed_ddp at 6; zero2 resumes that and trains to 8


def _cross_legs(root: Path) -> list[Leg]:
    workload = ClassifierWorkload("sgd_momentum")
    zero2 = zero_member("zero2", 2, stage=2)
    members = [Member("fsdp2@2", 2, FSDP2Strategy), Member("bucketed_ddp@2", 2, BucketedDDPStrategy), zero2]
    legs = [Leg(zero2, None, str(root / "cross_zero2"), CROSS_END, CROSS_END, save_at=SAVE_AT, workload=workload)]
    for index, member in enumerate(members, start=1):
        until = SAVE_AT + 2 * index
        path = str(root / f"cross_{index}_{member.name}")
        legs.append(Leg(member, legs[-1].save, path, min(until, CROSS_END), CROSS_END, workload=workload))
    return legs


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[Leg, LegResult]]]:
    root = tmp_path_factory.mktemp("any_optimizer")
    zero, cross = _zero_legs(root), _cross_legs(root)
    per_rank = run_distributed(_run, zero + cross, world_size=2, timeout_s=600)
    merged = []
    for index, leg in enumerate(zero + cross):
        ranks = [results[index] for results, _ in per_rank]
        loaded = merge_ranks([result.loaded for result in ranks]) if leg.load else None
        saved = merge_ranks([result.saved for result in ranks])
        merged.append((leg, LegResult(ranks[0].losses, loaded, saved, ranks[0].saved_step)))
    final = [merge_ranks([states[index] for _, states in per_rank]) for index in range(len(zero))]
    return {"zero": merged[: len(zero)], "cross": merged[len(zero) :], "final": final}


def _run(legs: list[Leg]) -> tuple[list[LegResult], list[dict[str, torch.Tensor] | None]]:
    return run_legs(legs, ""), FINAL


# ---- the checks -----------------------------------------------------------------------------------------------
def test_losses_match_one_process_with_the_same_optimizer(results: dict) -> None:
    references = {optimizer: single_process_losses(optimizer) for optimizer in OPTIMIZERS}
    for (name, optimizer), (_, result) in zip(CASES, results["zero"][::2], strict=True):
        reference = references[optimizer]
        worst = relative_difference(result.losses, reference)
        print(f"{name} {optimizer}: largest relative loss difference {worst:.2g}")
        assert worst <= TOLERANCE, (name, optimizer)
        assert reference[-1] < reference[0]  # it learned


def test_a_resumed_run_continues_the_uninterrupted_one_bitwise(results: dict) -> None:
    pairs = zip(results["zero"][::2], results["zero"][1::2], strict=True)
    for index, ((name, optimizer), ((first, uninterrupted), (_, resumed))) in enumerate(zip(CASES, pairs, strict=True)):
        _check_saved(first.save, uninterrupted.saved, STATE_KEYS[optimizer])
        assert resumed.loaded is not None
        check_loaded(resumed.loaded, uninterrupted.saved)  # weights, optimizer state and groups, bitwise
        assert resumed.losses == uninterrupted.losses[SAVE_AT:], (name, optimizer)
        final, final_resumed = results["final"][2 * index], results["final"][2 * index + 1]
        assert final.keys() == final_resumed.keys()
        assert all(same(final[key], value) for key, value in final_resumed.items()), (name, optimizer)


def test_an_sgd_momentum_checkpoint_moves_between_zero_fsdp2_and_ddp(results: dict) -> None:
    legs = results["cross"]
    uninterrupted = legs[0][1].losses
    assert len(uninterrupted) == CROSS_END
    saved = {leg.save: result.saved for leg, result in legs}
    for leg, result in legs[1:]:
        assert result.loaded is not None
        check_loaded(result.loaded, saved[leg.load])
        assert any(key.endswith(".momentum_buffer") for key in result.loaded), leg.member.name
        start = leg.until - len(result.losses)
        assert relative_difference(result.losses, uninterrupted[start : leg.until]) <= TOLERANCE, leg.member.name
    for leg, result in legs:
        _check_saved(leg.save, result.saved, {"momentum_buffer"})


def _check_saved(path: str, live: dict[str, Any], keys: set[str]) -> None:
    """The checkpoint holds exactly the live tensors at the save, bitwise, and the optimizer's ``keys``."""
    offline = read_offline(path)
    tensors = _tensors(live)
    assert sorted(offline) == sorted(tensors)
    assert all(same(offline[key], value) for key, value in tensors.items())
    saved_keys = {key.rsplit(".", 1)[1] for key in offline if key.startswith("optimizer.state.")}
    assert saved_keys == keys, saved_keys


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def test_offload_steps_other_optimizers_with_torch_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightscale.strategies.deepspeed import engine as deepspeed_engine

    said: list[str] = []
    monkeypatch.setattr(deepspeed_engine, "rank_zero_info", said.append)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    assert deepspeed_engine.host_optimizer(sgd, {}) is sgd
    assert said == ["lightscale: optimizer offload steps SGD with torch's own implementation on the host."]


def test_adagrad_with_several_groups_is_refused() -> None:
    from lightscale.errors import ConfigurationError
    from lightscale.strategies.deepspeed.engine import check_zero_optimizer

    groups = [{"params": [nn.Parameter(torch.zeros(2))]}, {"params": [nn.Parameter(torch.zeros(2))], "lr": 0.5}]
    with pytest.raises(ConfigurationError, match=r"Adagrad with 2 parameter groups under ZeRO.*one group"):
        check_zero_optimizer(torch.optim.Adagrad(groups, lr=0.1))
