"""Adafactor and Muon (+ AdamW, one CombinedOptimizer) under hsdp at 4 gloo ranks: 2 replica groups x 2 shards, so
each parameter is a DTensor on a 2-D mesh (Replicate, Shard(0)). The sharded steppers complete their statistics and
gather their matrices over the shard dimension only; the parameters equal one process's after ``STEPS`` steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import quiet_trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.optim import CombinedOptimizer
from lightscale.testing import run_distributed

TOLERANCE = 1e-5
STEPS, BATCH = 4, 8


def _optimizer(name: str, module: nn.Module) -> torch.optim.Optimizer:
    if name == "adafactor":
        return torch.optim.Adafactor(module.parameters(), lr=0.05, weight_decay=0.01)
    matrices = [p for p in module.parameters() if p.ndim == 2]
    rest = [p for p in module.parameters() if p.ndim != 2]
    return CombinedOptimizer([torch.optim.Muon(matrices, lr=0.05), torch.optim.AdamW(rest, lr=0.01)])


class MLP(pl.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.up = nn.Linear(8, 15)  # 15 rows over 2 shards: 8 + 7
        self.down = nn.Linear(15, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.down(torch.tanh(self.up(x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.optimizer_name, self)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def reference(optimizer: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = MLP(optimizer)
    step = module.configure_optimizers()
    for _ in range(STEPS):
        module.training_step(_batch(), 0).backward()
        step.step()
        step.zero_grad()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


class _Final(pl.Callback):
    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        stepped = trainer.strategy.optimizers[0]
        self.out["stepped"] = [type(o).__name__ for o in getattr(stepped, "optimizers", [stepped])]
        self.out["placements"] = str(module.up.weight.placements)
        full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in module.named_parameters()}
        self.out["params"] = {name: p.detach().clone() for name, p in full.items()}


def _run() -> dict[str, Any]:
    out = {}
    for optimizer in ("adafactor", "muon"):
        pl.seed_everything(0, verbose=False)
        final = _Final()
        trainer = quiet_trainer("hsdp", devices=4, max_steps=STEPS, callbacks=[final])
        trainer.fit(MLP(optimizer), DataLoader(TensorDataset(*_batch()), batch_size=BATCH // 4))
        out[optimizer] = final.out
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_run, world_size=4, timeout_s=300)


@pytest.mark.parametrize(
    ("optimizer", "stepped"), [("adafactor", ["ShardedAdafactor"]), ("muon", ["ShardedMuon", "AdamW"])]
)
def test_hsdp_equals_one_process(ranks: list[dict[str, Any]], optimizer: str, stepped: list[str]) -> None:
    expected = reference(optimizer)
    for result in ranks:
        run = result[optimizer]
        assert run["stepped"] == stepped and run["placements"] == "(Replicate(), Shard(dim=0))"
        error = max((run["params"][name] - expected[name]).abs().max().item() for name in expected)
        assert error <= TOLERANCE, (optimizer, error)
