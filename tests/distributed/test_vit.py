"""The ViT recipe reproduces single-process plain-SGD training under one strategy of each family, tp=2 and pp=2."""

from __future__ import annotations

from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import StepLosses, quiet_trainer, relative_difference

from lightscale.recipes.vit import ImageDataModule, ViTConfig, ViTModule
from lightscale.testing import run_distributed

TOLERANCE = 1e-5
STEPS = 8
GLOBAL_BATCH = 8
TINY = ViTConfig.named("tiny", n_embd=16)
DATA_PARALLEL = {"tp2": 1, "pp2": 1, "tp2_pp2": 1}


class SGDViT(ViTModule):
    def __init__(self) -> None:
        super().__init__(TINY, max_shift=0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # A large rate: 8 steps of a small one stay at chance; this one moves the losses far (upwards, too).
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(strategy: str, devices: int, dp: int, root: str) -> list[float]:
    pl.seed_everything(1234, verbose=False)
    losses = StepLosses()
    trainer = quiet_trainer(strategy, devices=devices, max_steps=STEPS, callbacks=[losses], default_root_dir=root)
    trainer.fit(SGDViT(), ImageDataModule(batch_size=GLOBAL_BATCH // dp))
    return losses.local


@cache
def reference(root: str) -> tuple[float, ...]:
    return tuple(run_distributed(fit, "auto", 1, 1, root, world_size=1)[0])


@pytest.mark.parametrize("name", ["bucketed_ddp", "zero2", "fsdp2", "tp2", "pp2"])
def test_vit_matches_single_process_sgd(name: str, tmp_path: Any) -> None:
    ranks = 2
    per_rank = run_distributed(fit, name, ranks, DATA_PARALLEL.get(name, ranks), str(tmp_path), world_size=ranks)
    losses = [sum(step) / ranks for step in zip(*per_rank, strict=True)]
    expected = reference(str(tmp_path))
    print(f"{name}: loss rel diff {relative_difference(losses, list(expected)):.2e}")
    assert relative_difference(losses, list(expected)) <= TOLERANCE
    assert abs(expected[-1] - expected[0]) > 0.1  # the steps move the model far more than the tolerance
