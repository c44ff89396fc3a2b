"""A replica that healed mid-epoch, saved, and was resumed reads on where its sampler was, not where Lightning's
batch count says: the heal moved its sampler ``JUMP`` batches past that count (the peer's position), so the save
must carry the jump (``lightscale.fault_tolerance.offset``) or the resumed run trains ``JUMP`` batches twice.

The user's model reads a dataset whose first column is the sample's index; torchft's manager is a fake (the seam
``FaultTolerantReplica(settings, manager=...)``) that, like torchft's synchronous quorum, loads a peer's state inside
the first quorum: this replica's own state with the position ``JUMP`` batches ahead.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from test_fault_tolerant_commit import SETTINGS, FakeManager
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.data.sampler import ExactlyOnceSampler
from lightscale.fault_tolerance.replica import FaultTolerantReplica
from lightscale.strategies import BucketedDDPStrategy
from lightscale.testing import run_distributed

SAMPLES, BATCH = 64, 8  # 8 batches an epoch
JUMP, SAVED_AT, RESUMED_STEPS = 2, 3, 3


class IndexedRegression(pl.LightningModule):
    """The user's model: SGD with momentum on its own dataset, whose first column names each sample."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 1)
        self.read: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.read.append(index.tolist())
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        data = torch.randn(SAMPLES, 5, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(torch.arange(SAMPLES), data, data.sum(-1, keepdim=True)), batch_size=BATCH)


class HealsAtFirstQuorum(FakeManager):
    """torchft's synchronous quorum healing this replica at its first quorum from a peer ``JUMP`` batches ahead."""

    def __init__(self, replica: FaultTolerantReplica | None = None) -> None:
        super().__init__(participants=1)
        self.replica = replica

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        super().start_quorum(allow_heal, shrink_only, timeout)
        if self.replica is not None and self.quorums == 1:
            peer = self.replica.state_dict()
            peer["position"] = [peer["position"][0], peer["position"][1] + JUMP]
            self.replica.load_state_dict(peer)


def _fit(root: str, heal: bool, max_steps: int, ckpt_path: str | None) -> dict[str, Any]:
    strategy = BucketedDDPStrategy(fault_tolerant=SETTINGS)
    manager = HealsAtFirstQuorum()
    strategy.ft = FaultTolerantReplica(SETTINGS, manager=manager)
    manager.replica = strategy.ft if heal else None
    every = ModelCheckpoint(dirpath=root, every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        callbacks=[every],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    model = IndexedRegression()
    trainer.fit(model, ckpt_path=ckpt_path)
    return {"read": model.read, "heals": strategy.ft.heals}


def _order() -> list[list[int]]:
    """Epoch 0's batches in the order a one-rank fit reads them (Lightning's shuffled sampler, lightscale's)."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    order = list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=1, rank=0, shuffle=True, seed=seed))
    return [order[i : i + BATCH] for i in range(0, SAMPLES, BATCH)]


def test_a_healed_replica_resumed_from_its_own_save_reads_on_where_its_sampler_was(tmp_path: Path) -> None:
    batches = _order()
    healed = run_distributed(_fit, str(tmp_path), True, SAVED_AT + 1, None, world_size=1, timeout_s=120)[0]
    assert healed["heals"] == 1
    assert healed["read"] == batches[JUMP : JUMP + SAVED_AT + 1]  # the heal moved the sampler JUMP batches on

    save = tmp_path / f"epoch=0-step={SAVED_AT}.ckpt"
    assert torch.load(save / "trainer_state.pt")["lightscale"]["fault_tolerance"]["offset"] == [0, JUMP]
    resumed = run_distributed(
        _fit, str(tmp_path / "resumed"), False, SAVED_AT + RESUMED_STEPS, str(save), world_size=1, timeout_s=120
    )[0]
    # On from the save's position: batch JUMP + SAVED_AT of the epoch; without the jump it re-read JUMP batches.
    assert resumed["read"] == batches[JUMP + SAVED_AT : JUMP + SAVED_AT + RESUMED_STEPS]
