"""torch.optim.Muon under zero1, zero2 and zero2_offload (2 gloo ranks) steps as in one process: the strategy installs
FlatMuon (lightscale/optim/flat_muon.py), which orthogonalizes each matrix whole, once, on an owner rank, while
DeepSpeed hands the optimizer flat 1-D partitions.

The model is a bias-free MLP, 8 -> 15 -> 4: ``up.weight`` (120 elements) and ``down.weight`` (60) laid end to end,
180 elements, 90 per rank. So ``up.weight`` is split 90 + 30 over the ranks (gathered to its owner, rank 0) and
``down.weight`` lies inside rank 1's partition (orthogonalized there, no bytes moved).

One launch runs, on each rank:
    * zero1, zero2 and zero2_offload for ``STEPS`` steps, counting the optimizer's gathers and scatters; zero2 saves at
      ``SAVE_AT``, and a zero2 run resumes that checkpoint;
    * FlatMuon on hand-built flat partitions (no DeepSpeed): the same layout, and a planted error (Newton-Schulz on
      each rank's piece alone) that must not match.
Checked: the parameters equal one process's torch.optim.Muon (to the fp32 rounding of the gradient average), the
hand-built partitions bitwise; each step moves one gather and one scatter of 90 bf16 elements (180 B) per rank; the
resumed run ends bitwise where the uninterrupted one does; the estimator counts the momentum buffer exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import CountingDist, backward_as_two_ranks, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.estimate import estimate_memory
from lightscale.optim import flat_muon, muon
from lightscale.optim.flat_muon import FlatGroup, FlatMuon, FlatSpan, flat_muon_from
from lightscale.testing import run_distributed

TOLERANCE = 1e-6  # absolute, on the parameters: the gradient averages differ from one process in order only
STEPS, SAVE_AT, BATCH, LR = 6, 3, 8, 0.05
NAMES = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
# Per step, this rank's (kind, bytes, owner) of Muon's gathers and scatters. ZeRO-1/2: up.weight split 90 + 30 (padded
# to 90 bf16 = 180 B, owned by rank 0), down.weight inside rank 1's partition (nothing moved). ZeRO-3 splits each
# matrix in halves: up.weight 60 + 60 (120 B, owner rank 0), down.weight 30 + 30 (60 B, owner rank 1, the next turn).
STAGE12 = [("gather", 180, 0), ("scatter", 180, 0)]
STAGE3 = [("gather", 120, 0), ("gather", 60, 1), ("scatter", 120, 0), ("scatter", 60, 1)]
CALLS = {"zero1": STAGE12, "zero2": STAGE12, "zero2_offload": STAGE12, "zero3": STAGE3, "zero3_offload": STAGE3}


class MLP(pl.LightningModule):
    def __init__(self, groups: bool = False) -> None:
        super().__init__()
        self.groups = groups
        self.up = nn.Linear(8, 15, bias=False)
        self.down = nn.Linear(15, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.groups:  # one group per matrix, the second at half the rate; a schedule halving both every 2 steps
            groups = [{"params": [self.up.weight]}, {"params": [self.down.weight], "lr": LR / 2}]
            optimizer = torch.optim.Muon(groups, lr=LR)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}
        return torch.optim.Muon(self.parameters(), lr=LR)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def reference(groups: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = MLP(groups)
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if groups else configured
    for epoch in range(STEPS):  # one batch per epoch: Lightning steps the scheduler after every step
        backward_as_two_ranks(module, _batch(), epoch=epoch)
        optimizer.step()
        optimizer.zero_grad()
        if groups:
            configured["lr_scheduler"].step()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# ---- on each rank --------------------------------------------------------------------------------------------
class _Final(pl.Callback):
    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        engine = getattr(trainer.strategy, "engine", None)  # DeepSpeed's ZeRO optimizer wraps the user's
        inner = engine.optimizer.optimizer if engine is not None else trainer.strategy.optimizers[0]
        self.out["optimizer"] = type(inner).__name__
        self.out["state_bytes"] = sum(t.nbytes for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
        import deepspeed  # an extra: imported once the strategy has named the CPU accelerator

        with deepspeed.zero.GatheredParameters(list(module.parameters())):  # ZeRO-3: whole for the moment
            self.out["params"] = {name: p.detach().clone() for name, p in module.named_parameters()}


def _fit(
    name: str, root: str, *, save_at: int | None = None, resume: str | None = None, groups: bool = False
) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    final, counting = _Final(), CountingDist()
    callbacks: list[pl.Callback] = [final]
    if save_at is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=root, filename="saved-{step}", every_n_train_steps=save_at, save_top_k=-1)
        )
    trainer = quiet_trainer(name, devices=2, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=bool(save_at))
    with mock.patch.object(muon, "dist", counting):
        trainer.fit(MLP(groups), DataLoader(TensorDataset(*_batch()), batch_size=BATCH // 2), ckpt_path=resume)
    return final.out | {"calls": counting.calls}


def _hand_built(planted: bool) -> float:
    """Four steps of FlatMuon on flat partitions built by hand as ZeRO-1/2 lays them (90 elements per rank) vs
    torch's Muon on the whole matrices: the largest difference."""
    generator = torch.Generator().manual_seed(1)
    shapes = [torch.Size((15, 8)), torch.Size((4, 15))]
    init = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(4)]
    whole = [nn.Parameter(t.clone()) for t in init]
    reference_optimizer = torch.optim.Muon(whole, lr=LR)
    rank = dist.get_rank()
    mine = slice(90 * rank, 90 * (rank + 1))
    partition = nn.Parameter(torch.cat([t.reshape(-1) for t in init])[mine].clone())
    ours = flat_muon_from(torch.optim.Muon([nn.Parameter(t.clone()) for t in init], lr=LR))
    ours.param_groups[0]["params"] = [partition]  # what DeepSpeed does to each group
    spans = (FlatSpan(shapes[0], (90, 30), 0), FlatSpan(shapes[1], (0, 60), 30))
    ours.attach([FlatGroup(partition, spans, dist.group.WORLD, rank, partition.device)])
    for step_grads in grads:
        for param, grad in zip(whole, step_grads, strict=True):
            param.grad = grad.clone()
        partition.grad = torch.cat([g.reshape(-1) for g in step_grads])[mine].clone()
        reference_optimizer.step()
        if planted:  # the planted error: each rank orthogonalizes its own piece as if it were the matrix
            with mock.patch.object(flat_muon, "orthogonalize_splits", _local_only):
                ours.step()
        else:
            ours.step()
    full = [torch.empty(90) for _ in range(2)]
    dist.all_gather(full, partition.detach())
    flat = torch.cat(full)
    expected = torch.cat([p.detach().reshape(-1) for p in whole])
    return (flat - expected).abs().max().item()


def _local_only(
    splits: list[muon.Split], *, coefficients: tuple, steps: int, eps: float, **_: Any
) -> list[torch.Tensor]:
    return [
        muon.newton_schulz(s.local.reshape(1, -1), coefficients, steps, eps).reshape(-1) if len(s.local) else s.local
        for s in splits
    ]


def _run(root: str) -> dict[str, Any]:
    out = {name: _fit(name, f"{root}/{name}", save_at=SAVE_AT if name == "zero2" else None) for name in NAMES}
    saved = str(Path(root) / "zero2" / f"saved-step={SAVE_AT}.ckpt")
    out["resumed"] = _fit("zero2", f"{root}/resumed", resume=saved)
    out["ddp_resumed"] = _fit("bucketed_ddp", f"{root}/ddp_resumed", resume=saved)  # torch's own Muon
    out["zero2_groups"] = _fit("zero2", f"{root}/groups", groups=True)
    return out | {"hand_built": _hand_built(planted=False), "planted": _hand_built(planted=True)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_run, str(tmp_path_factory.mktemp("zero_muon")), world_size=2, timeout_s=600)


# ---- the checks -----------------------------------------------------------------------------------------------
def _error(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((params[name] - expected[name]).abs().max().item() for name in expected)


@pytest.mark.parametrize("name", NAMES)
def test_parameters_equal_one_process(ranks: list[dict[str, Any]], name: str) -> None:
    expected = reference()
    for result in ranks:
        assert result[name]["optimizer"] == FlatMuon.__name__  # installed in place of torch's
        error = _error(result[name]["params"], expected)
        print(f"{name}: max |param - one process| = {error:.2g}")
        assert error <= TOLERANCE, (name, error)


def test_hand_built_partitions_bitwise_and_the_planted_error_fails(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        assert result["hand_built"] == 0.0  # each matrix orthogonalized whole: op for op as one process
        assert result["planted"] > 1e-2  # Newton-Schulz of the pieces alone: another optimizer


@pytest.mark.parametrize("name", NAMES)
def test_one_gather_and_one_scatter_per_split_matrix(ranks: list[dict[str, Any]], name: str) -> None:
    for result in ranks:
        assert result[name]["calls"] == CALLS[name] * STEPS


def test_resume_under_zero2_is_bitwise(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        uninterrupted, resumed = result["zero2"]["params"], result["resumed"]["params"]
        assert all(torch.equal(resumed[name], value) for name, value in uninterrupted.items())
        assert len(result["resumed"]["calls"]) == 2 * (STEPS - SAVE_AT)


def test_bucketed_ddp_resumes_zero2s_checkpoint_with_torchs_muon(ranks: list[dict[str, Any]]) -> None:
    """The portable checkpoint holds torch's momentum buffers per parameter: torch's own Muon continues from it."""
    expected = reference()
    for result in ranks:
        assert result["ddp_resumed"]["optimizer"] == "Muon"
        assert _error(result["ddp_resumed"]["params"], expected) <= TOLERANCE


def test_parameter_groups_each_stepped_with_their_own_rate(ranks: list[dict[str, Any]]) -> None:
    """One flat partition per group (ZeRO-1/2), each at its own rate and the LR schedule followed: up.weight split
    60 + 60, down.weight 30 + 30; the owners take turns across the groups within a step (rank 0, then rank 1)."""
    expected = reference(groups=True)
    step = [("gather", 120, 0), ("scatter", 120, 0), ("gather", 60, 1), ("scatter", 60, 1)]
    for result in ranks:
        assert _error(result["zero2_groups"]["params"], expected) <= TOLERANCE
        assert result["zero2_groups"]["calls"] == step * STEPS


def test_estimator_counts_the_momentum_buffer_exactly(ranks: list[dict[str, Any]]) -> None:
    """One fp32 value per element of the rank's partition (90: ZeRO-1/2 90 of the 180 laid end to end, ZeRO-3 60 + 30),
    as SGD's momentum: 360 B on each rank."""
    for name in ("zero1", "zero2", "zero3"):
        predicted = estimate_memory(MLP(), name, world_size=2, optimizer=torch.optim.Muon, activations=False)
        master = 4 * 90  # DeepSpeed's fp32 master partition, counted with the optimizer state
        for result in ranks:
            assert result[name]["state_bytes"] == 4 * 90
            assert predicted.optimizer.total == master + result[name]["state_bytes"], name
