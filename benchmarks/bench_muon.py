"""Muon's optimizer step under fsdp2 (ShardedMuon: each matrix orthogonalized once, by its owner rank) against
bucketed_ddp (torch's Muon: every rank orthogonalizes every matrix) and against AdamW under fsdp2; and under zero2
(FlatMuon on DeepSpeed's flat partitions) against bucketed_ddp.

The zero2 pair (written while ZeRO refused a CombinedOptimizer) trains Muon alone on the 2-D weights with the rest
frozen (``muon_only``), under zero2 and bucketed_ddp alike; its time is DeepSpeed's whole step (FlatMuon's step plus the
all-gather of the updated partitions and the copies around it), the one that replaces DDP's ``optimizer.step()``.

Every torch optimizer is stepped as a part of a ``CombinedOptimizer`` (one part or two), which runs Lightning's
closure (forward and backward) before the parts' steps: torch's own ``step(closure)`` runs the closure inside
itself, so its step hooks would time forward and backward too (the AdamW figures before this change did).

The GPT recipe's model (below), its data and LR schedule; the optimizer is a CombinedOptimizer of Muon for the 2-D
weights and AdamW for the rest, or AdamW for all. Timed: ``optimizer.step()`` alone (torch's step pre/post hooks on the
optimizer the strategy steps), warm-up steps dropped; 2 forked gloo ranks, interleaved ABBA, medians. fp32 weights,
bf16 Newton-Schulz (torch's). On CPU the 2 ranks share the machine's cores, so "once per matrix" halves the total
Newton-Schulz work but each rank still waits for its owned half.

    python benchmarks/bench_muon.py [--repeats 2] [--steps 4] [--ranks 2] [--cases muon_only_zero2 muon_only_ddp]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, median, timed_trainer

from lightscale.optim import CombinedOptimizer
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.testing import run_distributed

MODEL = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=256)
WARMUP = 2
CASES = {
    "muon_fsdp2": ("fsdp2", "muon"),
    "muon_ddp": ("bucketed_ddp", "muon"),
    "adamw_fsdp2": ("fsdp2", "adamw"),
    "muon_only_zero2": ("zero2", "muon_only"),
    "muon_only_ddp": ("bucketed_ddp", "muon_only"),
}


class GPTWith(GPTModule):
    """The GPT recipe with Muon (2-D weights) + AdamW (the rest), AdamW for all, or Muon alone (the rest frozen)."""

    def __init__(self, config: GPTConfig, optimizer: str) -> None:
        super().__init__(config)
        self.optimizer_name = optimizer

    def configure_model(self) -> None:
        super().configure_model()
        if self.optimizer_name == "muon_only":  # ZeRO takes one optimizer: the rest stays frozen in both runs
            for p in self.parameters():
                p.requires_grad_(p.ndim == 2)

    def configure_optimizers(self) -> Any:
        parts = self._optimizers()
        if self.trainer.strategy.optimizer_parameter_view().startswith("flat"):  # kept as measured: Muon alone
            (only,) = parts
            return only  # Lightning runs its closure before DeepSpeed's step, which is what is timed
        # torch's step runs Lightning's closure (forward and backward) inside itself: as parts of a CombinedOptimizer
        # the closure runs first, and the parts' step hooks time the steps alone.
        return CombinedOptimizer(parts)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        if self.optimizer_name == "adamw":
            return [torch.optim.AdamW(self.parameters(), lr=3e-3)]
        matrices = [p for p in self.parameters() if p.ndim == 2]
        if self.optimizer_name == "muon_only":
            return [torch.optim.Muon(matrices, lr=0.02)]
        rest = [p for p in self.parameters() if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


class OptimizerTimer(pl.Callback):
    """Seconds of each ``optimizer.step()`` after the warm-up, from torch's step hooks on the stepped optimizer."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        if not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's ZeRO optimizer: time its whole step
            step = optimizer.step

            def timed_step(*args: Any, **kwargs: Any) -> Any:
                self._before()
                out = step(*args, **kwargs)
                self._after(trainer)
                return out

            optimizer.step = timed_step
            return
        parts = getattr(optimizer, "optimizers", [optimizer])
        parts[0].register_step_pre_hook(self._before)
        parts[-1].register_step_post_hook(lambda *_: self._after(trainer))

    def _before(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def _after(self, trainer: pl.Trainer) -> None:
        if trainer.global_step >= WARMUP:
            self.times.append(time.perf_counter() - self._start)


def _one(case: str, steps: int) -> tuple[list[float], str]:
    strategy, optimizer = CASES[case]
    pl.seed_everything(0, verbose=False)
    timer = OptimizerTimer()
    trainer = timed_trainer(strategy, devices=dist.get_world_size(), steps=WARMUP + steps, callbacks=[timer])
    trainer.fit(GPTWith(MODEL, optimizer), GPTDataModule(block_size=MODEL.block_size, batch_size=4))
    stepped = trainer.strategy.optimizers[0]
    if not isinstance(stepped, torch.optim.Optimizer):
        stepped = stepped.optimizer  # DeepSpeed's ZeRO optimizer wraps the one that steps
    parts = [type(part).__name__ for part in getattr(stepped, "optimizers", [stepped])]
    return timer.times, "+".join(parts)


def _rank(repeats: int, steps: int, cases: list[str]) -> dict[str, Any]:
    times: dict[str, list[float]] = {case: [] for case in cases}
    names: dict[str, str] = {}
    for case in interleaved(cases, repeats):
        measured, names[case] = _one(case, steps)
        times[case] += measured
    return {"times": times, "names": names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (4 on a 2-core machine: oversubscribed)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    result = run_distributed(_rank, args.repeats, args.steps, args.cases, world_size=args.ranks, timeout_s=3000)[0]
    step = {case: median(values) for case, values in result["times"].items()}
    print(f"Muon optimizer step, GPT n_embd={MODEL.n_embd} n_layer={MODEL.n_layer}, {args.ranks} gloo ranks (rank 0):")
    for case, seconds in step.items():
        print(f"  {case:16s} {result['names'][case]:22s} {1e3 * seconds:8.1f} ms")
    ratios = {
        "Muon fsdp2 / Muon bucketed_ddp": ("muon_fsdp2", "muon_ddp"),
        "Muon fsdp2 / AdamW fsdp2": ("muon_fsdp2", "adamw_fsdp2"),
        "Muon zero2 / Muon bucketed_ddp (Muon alone)": ("muon_only_zero2", "muon_only_ddp"),
    }
    for label, (top, bottom) in ratios.items():
        if top in step and bottom in step:
            print(f"  {label}: {step[top] / step[bottom]:.2f}")


if __name__ == "__main__":
    main()
