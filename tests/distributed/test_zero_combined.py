"""A CombinedOptimizer under the ZeRO names (2 gloo ranks) steps as one process's: DeepSpeed makes one flat partition
per group and steps the optimizer with its groups narrowed to one; each part steps its own groups' partitions (torch's
Muon as FlatMuon, told where its matrices lie).

The model: bias-free matrices 8 -> 15 -> 4 (Muon, or SGD with momentum) with a LayerNorm between (its weight and bias:
AdamW). One launch runs, on each rank:
    * Muon + AdamW under zero2 (saving at ``SAVE_AT``), zero1, zero3 and zero3_offload; zero2 resumed from that
      checkpoint, and bucketed_ddp resumed from it (the portable layout: both parts' states move to torch's own
      optimizers);
    * SGD-momentum + AdamW under zero2 and zero2_offload (offload hands DeepSpeed's optimizer every group's gradient
      before it steps the groups one by one), and under zero2_offload with a planted error: every part stepping all
      its groups at each of DeepSpeed's per-group steps (what CombinedOptimizer did before it followed the narrowed
      groups: the AdamW part stepped again at the SGD group's turn, and the SGD part at AdamW's).
Checked: the parameters equal one process's CombinedOptimizer to the fp32 rounding of the gradient averages (two
ranks' half-batch gradients averaged vs one whole batch: not bitwise); the zero2 resume ends bitwise where the
uninterrupted run ends; the planted error is far off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from helpers import backward_as_two_ranks, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.optim import CombinedOptimizer, combined
from lightscale.testing import run_distributed

TOLERANCE = 1e-6  # absolute, on the parameters: the gradient averages differ from one process in order only
STEPS, SAVE_AT, BATCH = 6, 3, 8


class MLP(pl.LightningModule):
    def __init__(self, kind: str = "muon") -> None:
        super().__init__()
        self.kind = kind
        self.up = nn.Linear(8, 15, bias=False)
        self.norm = nn.LayerNorm(15)
        self.down = nn.Linear(15, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.norm(self.up(x))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self, self.kind)


def make_optimizer(module: nn.Module, kind: str) -> CombinedOptimizer:
    matrices = [p for p in module.parameters() if p.ndim == 2]
    rest = [p for p in module.parameters() if p.ndim != 2]
    first = torch.optim.Muon(matrices, lr=0.05) if kind == "muon" else torch.optim.SGD(matrices, lr=0.1, momentum=0.9)
    return CombinedOptimizer([first, torch.optim.AdamW(rest, lr=0.01)])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, 8, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def reference(kind: str) -> dict[str, torch.Tensor]:
    """One process, the whole batch, the same CombinedOptimizer."""
    torch.manual_seed(0)
    module = MLP(kind)
    optimizer = make_optimizer(module, kind)
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
        engine = getattr(trainer.strategy, "engine", None)  # DeepSpeed's ZeRO optimizer wraps the user's
        inner = engine.optimizer.optimizer if engine is not None else trainer.strategy.optimizers[0]
        self.out["parts"] = [type(part).__name__ for part in inner.optimizers]
        if engine is None:
            self.out["params"] = {name: p.detach().clone() for name, p in module.named_parameters()}
            return
        import deepspeed  # an extra: imported once the strategy has named the CPU accelerator

        with deepspeed.zero.GatheredParameters(list(module.parameters())):  # ZeRO-3: whole for the moment
            self.out["params"] = {name: p.detach().clone() for name, p in module.named_parameters()}


def _fit(name: str, root: str, kind: str = "muon", *, save: bool = False, resume: str | None = None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    final = _Final()
    callbacks: list[pl.Callback] = [final]
    if save:
        callbacks.append(ModelCheckpoint(root, filename="saved-{step}", every_n_train_steps=SAVE_AT, save_top_k=-1))
    trainer = quiet_trainer(name, devices=2, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=save)
    trainer.fit(MLP(kind), DataLoader(TensorDataset(*_batch()), batch_size=BATCH // 2), ckpt_path=resume)
    return final.out


@torch.no_grad()
def _every_part(self: CombinedOptimizer, closure: Any = None) -> Any:
    """The planted error: every part steps all its groups, whichever group DeepSpeed narrowed ``param_groups`` to."""
    loss = combined.closure_loss(closure)
    for optimizer in self.optimizers:
        optimizer.step()
    return loss


def _run(root: str) -> dict[str, Any]:
    out = {"zero2": _fit("zero2", f"{root}/zero2", save=True)}
    out |= {name: _fit(name, f"{root}/{name}") for name in ("zero1", "zero3", "zero3_offload")}
    saved = str(Path(root) / "zero2" / f"saved-step={SAVE_AT}.ckpt")
    out["zero2_resumed"] = _fit("zero2", f"{root}/resumed", resume=saved)
    out["ddp_resumed"] = _fit("bucketed_ddp", f"{root}/ddp_resumed", resume=saved)  # torch's own Muon and AdamW
    out["sgd_zero2"] = _fit("zero2", f"{root}/sgd", "sgd")
    out["sgd_zero2_offload"] = _fit("zero2_offload", f"{root}/sgd_offload", "sgd")
    with mock.patch.object(CombinedOptimizer, "step", _every_part):
        out["planted"] = _fit("zero2_offload", f"{root}/planted", "sgd")
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_run, str(tmp_path_factory.mktemp("zero_combined")), world_size=2, timeout_s=600)


# ---- the checks -----------------------------------------------------------------------------------------------
def _error(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((params[name] - expected[name]).abs().max().item() for name in expected)


@pytest.mark.parametrize(
    ("run", "kind", "parts"),
    [
        ("zero2", "muon", ["FlatMuon", "AdamW"]),
        ("zero1", "muon", ["FlatMuon", "AdamW"]),
        ("zero3", "muon", ["FlatMuon", "AdamW"]),
        ("zero3_offload", "muon", ["FlatMuon", "AdamW"]),
        ("zero2_resumed", "muon", ["FlatMuon", "AdamW"]),
        ("ddp_resumed", "muon", ["Muon", "AdamW"]),
        ("sgd_zero2", "sgd", ["SGD", "AdamW"]),
        ("sgd_zero2_offload", "sgd", ["SGD", "AdamW"]),
    ],
)
def test_parameters_equal_one_process(ranks: list[dict[str, Any]], run: str, kind: str, parts: list[str]) -> None:
    expected = reference(kind)
    for result in ranks:
        assert result[run]["parts"] == parts
        error = _error(result[run]["params"], expected)
        assert error <= TOLERANCE, (run, error)


def test_zero2_resume_is_bitwise(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        for name, value in result["zero2"]["params"].items():
            assert torch.equal(value, result["zero2_resumed"]["params"][name]), name


def test_a_planted_error_fails(ranks: list[dict[str, Any]]) -> None:
    """Every part stepping all its groups at each per-group step: each part steps twice per step under offload (its
    gradients are all there before the first group's turn)."""
    for result in ranks:
        assert _error(result["planted"]["params"], reference("sgd")) > 1e-3
