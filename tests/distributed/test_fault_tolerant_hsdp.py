"""``FSDP2Strategy(fault_tolerant=...)`` (hsdp through torchft): 2 replicas x 2 ranks, each replica a launch of
Lightning's launcher sharding over its own 2 ranks, a lighthouse on loopback.

While both live the run equals FSDP2 at the whole world size of 4 (SGD with momentum, 1e-6): FSDP2's mean over a
replica's ranks, then torchft's mean over the replicas.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from event_log import event_writer, read_events
from test_fault_tolerant_step import _done, _finish, _launches

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

SAMPLES, BATCH, LR, MOMENTUM, STEPS, RANKS = 1024, 8, 0.05, 0.9, 4, 2
DEADLINE_S = 180  # four processes start on a shared CPU: most of the time is imports


def _network() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> Any:
    import torch

    x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(1))
    return x, x.sum(-1, keepdim=True).sin().expand(-1, 4).contiguous()


def _run(mode: str, replica: int, log: str, port: int, wait_for: str | None) -> None:
    """One replica: a launch of ``RANKS`` ranks (Lightning's launcher re-runs this file for its other rank)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import lightscale
    from lightscale.strategies import FSDP2Strategy

    write = event_writer(log, mode=mode, replica=replica, rank=int(os.environ.get("LOCAL_RANK", 0)))

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _network()
            self.x, self.y = _data()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

        def train_dataloader(self) -> Any:
            return DataLoader(TensorDataset(self.x, self.y), batch_size=BATCH, shuffle=True)

    class Events(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ft = trainer.strategy.ft
            write("step", step=trainer.global_step, participants=ft.step.participants)

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in module.parameters()])
            write("done", step=trainer.global_step, params=flat.tolist())

    ft = lightscale.FaultTolerance(
        replica_id=f"replica_{replica}", lighthouse=f"http://127.0.0.1:{port}", data_shards=2,
        min_replicas=2, timeout_s=10, quorum_timeout_s=30,
    )  # fmt: skip
    trainer = pl.Trainer(strategy=FSDP2Strategy(fault_tolerant=ft, meta_init=False), accelerator="cpu",
                         devices=RANKS, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[Events()],
                         limit_val_batches=0)  # fmt: skip
    trainer.fit(Regression())


def _fsdp2_at_world_size_four() -> Any:
    """What FSDP2 on 4 ranks computes (tests/distributed/test_fsdp2_parity.py holds it to this): each step the mean
    of the 4 ranks' gradients, rank k reading shard k of the shuffled order; no process needed."""
    import torch
    import torch.nn.functional as F

    from lightscale.data.sampler import ExactlyOnceSampler

    net = _network()
    x, y = _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    world = 2 * RANKS
    shards = [list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=world, rank=k, shuffle=True))
              for k in range(world)]  # fmt: skip
    for step in range(STEPS):
        optimizer.zero_grad()
        for shard in shards:
            index = shard[step * BATCH : (step + 1) * BATCH]
            (F.mse_loss(net(x[index]), y[index]) / world).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_two_hsdp_replicas_equal_fsdp2_at_world_size_four(tmp_path: Path) -> None:
    import torch

    deadline = time.monotonic() + DEADLINE_S
    with _launches(tmp_path, min_replicas=2, script=__file__) as start:
        _finish([start("ft", 0), start("ft", 1)], tmp_path, deadline)
    reference = _fsdp2_at_world_size_four()
    ends = [torch.tensor(e["params"]) for e in _done(tmp_path, mode="ft")]
    assert len(ends) == 2 * RANKS and all(torch.equal(end, ends[0]) for end in ends)
    torch.testing.assert_close(ends[0], reference, rtol=1e-6, atol=1e-6)
    steps = [e for e in read_events(tmp_path / "events") if e["event"] == "step"]
    assert {e["participants"] for e in steps} == {2} and len(steps) == 2 * RANKS * STEPS
    assert f"lightscale-ft: step {STEPS} committed, 2 replica(s)" in (tmp_path / "ft0.0.txt").read_text()


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] or None)
