"""Adafactor and Muon (+ AdamW, one CombinedOptimizer) under tp2 (the GPT recipe's tensor-parallel plan on 2 gloo
ranks): weights split by rows and by columns, FSDP over the dp dimension on top. The losses of every step equal one
process with torch's own optimizer (the tiny GPT, the recipe's data, fp32)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, StepLosses, quiet_trainer, relative_difference

from lightscale.optim import CombinedOptimizer
from lightscale.recipes.gpt import GPTDataModule, GPTModule
from lightscale.testing import run_distributed

# Relative, per step. tp changes the order of the gradient sums only; Muon casts its update to bf16 before
# Newton-Schulz, so a last-bit difference in an fp32 gradient can move a bf16 element by one ulp, and no one-process
# reference sums as tp's split matrix products do. So Muon's bound is not derived but set well above what such flips
# do: one process with every gradient multiplied by (1 + 1e-7 * noise) moves by 1.3e-4 (tp2 measured 5.8e-5,
# bucketed_ddp and fsdp2 3.0e-6); 2e-3 is 15x that (what a wrong orthogonalization does to these losses is not measured
# here). The former 1e-4 was below the flips' 1.3e-4: met by luck. Adafactor (fp32, no flips; measured 0.0 under the
# same noise) under tp2 <= 1e-5: fp32 reassociation, ~1e-7 per step.
TOLERANCE = {"adafactor": 1e-5, "muon": 2e-3}
STEPS, GLOBAL_BATCH = 6, 8


class GPTWith(GPTModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__(TINY)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=0.02)
        matrices = [p for p in self.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if p.ndim != 2]
        return CombinedOptimizer([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)])


def _fit(strategy: str, optimizer: str, cache_dir: str) -> tuple[list[float], list[str]]:
    pl.seed_everything(1234, verbose=False)
    world = dist.get_world_size()
    data_parallel = 1 if strategy == "tp2" else world
    losses = StepLosses()
    trainer = quiet_trainer(strategy, devices=world, max_steps=STEPS, callbacks=[losses])
    data = GPTDataModule(block_size=TINY.block_size, batch_size=GLOBAL_BATCH // data_parallel, cache_dir=cache_dir)
    trainer.fit(GPTWith(optimizer), data)
    stepped = trainer.strategy.optimizers[0]
    return losses.local, [type(o).__name__ for o in getattr(stepped, "optimizers", [stepped])]


@pytest.mark.parametrize(
    ("optimizer", "stepped"), [("adafactor", ["ShardedAdafactor"]), ("muon", ["ShardedMuon", "AdamW"])]
)
def test_tp2_equals_one_process(optimizer: str, stepped: list[str], corpus_cache: str) -> None:
    reference = run_distributed(_fit, "auto", optimizer, corpus_cache, world_size=1, timeout_s=300)[0][0]
    per_rank = run_distributed(_fit, "tp2", optimizer, corpus_cache, world_size=2, timeout_s=300)
    assert all(names == stepped for _, names in per_rank)
    losses = [sum(step) / 2 for step in zip(*(losses for losses, _ in per_rank), strict=True)]
    assert relative_difference(losses, reference) <= TOLERANCE[optimizer], (losses, reference)
