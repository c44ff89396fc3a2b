"""torch.optim.Muon under fsdp2 (2 gloo ranks) steps as in one process: the strategy installs ShardedMuon
(lightscale/optim/muon.py), which orthogonalizes each matrix whole, once, on an owner rank.

One launch runs, on a bias-free MLP whose first weight has an odd number of rows (shards of 8 + 7):
    * fsdp2 for ``STEPS`` steps, counting the optimizer's gathers and scatters;
    * ShardedMuon and torch's Muon on hand-placed DTensors: rows split unevenly, rows split evenly, columns split
      (tensor parallel's Shard(1): gathered whole on every rank).
Checked: the parameters equal one process's torch.optim.Muon bitwise (fsdp2: its gradients the ranks' half batches'),
torch's own Muon on the same DTensors does not (its sharded bf16 products), and each step moves exactly one gather
and one scatter of ceil(M / 2) x N bf16 elements per matrix, owners taking turns.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import CountingDist, backward_as_two_ranks, quiet_trainer
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.optim import muon
from lightscale.optim.muon import ShardedMuon, sharded_muon_from
from lightscale.testing import run_distributed

TOLERANCE = 0.0  # bitwise: the reference averages the ranks' half-batch gradients as they do (backward_as_two_ranks)
STEPS, BATCH, LR = 6, 8, 0.05


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 15, bias=False)  # 15 rows: shards of 8 and 7
        self.down = nn.Linear(15, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Muon(self.parameters(), lr=LR)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = MLP()
    optimizer = module.configure_optimizers()
    for epoch in range(STEPS):  # one batch per rank per epoch
        backward_as_two_ranks(module, _batch(), epoch=epoch)
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ---- on each rank --------------------------------------------------------------------------------------------
class _Final(pl.Callback):
    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.out["optimizer"] = type(trainer.strategy.optimizers[0]).__name__
        full = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in module.named_parameters()}
        self.out["params"] = {name: p.detach().clone() for name, p in full.items()}


def _fit() -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    final, counting = _Final(), CountingDist()
    trainer = quiet_trainer("fsdp2", devices=2, max_steps=STEPS, callbacks=[final])
    with mock.patch.object(muon, "dist", counting):
        trainer.fit(MLP(), DataLoader(TensorDataset(*_batch()), batch_size=BATCH // 2))
    return final.out | {"calls": counting.calls}


SHAPES = {"rows_uneven": (7, 5), "rows_even": (16, 16), "wide": (5, 9), "columns": (4, 6)}
PLACEMENTS = {"rows_uneven": Shard(0), "rows_even": Shard(0), "wide": Shard(0), "columns": Shard(1)}


def _placed(make: str) -> float:
    """Four steps of Muon on hand-placed DTensors vs torch's Muon on whole tensors: the largest difference."""
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(1)
    init = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    grads = [{name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()} for _ in range(4)]
    whole = {name: nn.Parameter(t.clone()) for name, t in init.items()}
    placed = {name: nn.Parameter(distribute_tensor(t.clone(), mesh, [PLACEMENTS[name]])) for name, t in init.items()}
    reference_optimizer = torch.optim.Muon(whole.values(), lr=LR)
    ours: torch.optim.Optimizer = torch.optim.Muon(placed.values(), lr=LR)
    if make == "sharded":
        ours = sharded_muon_from(ours)
    for step_grads in grads:
        for name, grad in step_grads.items():
            whole[name].grad = grad.clone()
            placed[name].grad = distribute_tensor(grad.clone(), mesh, [PLACEMENTS[name]])
        reference_optimizer.step()
        ours.step()
    return max((placed[name].full_tensor() - whole[name]).abs().max().item() for name in SHAPES)


def _run() -> dict[str, Any]:
    return {"fsdp2": _fit(), "sharded": _placed("sharded"), "torch": _placed("torch")}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_run, world_size=2, timeout_s=300)


# ---- the checks -----------------------------------------------------------------------------------------------
def test_fsdp2_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    expected = reference()
    for result in ranks:
        assert result["fsdp2"]["optimizer"] == ShardedMuon.__name__
        error = max((result["fsdp2"]["params"][n] - expected[n]).abs().max().item() for n in expected)
        assert error <= TOLERANCE, error


def test_placed_dtensors_bitwise(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["sharded"] == 0.0  # each matrix orthogonalized whole: op for op as one process
        assert result["torch"] > 1e-3  # torch's own on DTensor: sharded bf16 products, rounded differently


def test_one_gather_and_one_scatter_per_matrix(ranks: list[dict[str, Any]]) -> None:
    """up.weight 15 x 8: 8 padded rows x 8 bf16 = 128 B, owned by rank 0; down.weight 4 x 15: 2 x 15 x 2 = 60 B,
    owned by rank 1 (round-robin). Both gathers are posted before any scatter."""
    step = [("gather", 128, 0), ("gather", 60, 1), ("scatter", 128, 0), ("scatter", 60, 1)]
    for result in ranks:
        assert result["fsdp2"]["calls"] == step * STEPS
