"""Expert parallelism vs the same MoE GPT with its experts sharded by FSDP2 like any weight; all-to-all time share.

Both sides: the same MoE GPT (routed experts in every block, top 2, dropless, bias balancing), the recipe's AdamW,
the same batches (every rank its own shard of the same global batch), fp32, 2 forked gloo ranks, interleaved ABBA,
warm-up steps dropped, ratio of median step times. ``ep2`` keeps each rank's half of the experts in place and
sends tokens to them (all-to-all); ``fsdp2`` all-gathers every expert's weights to every rank, which then runs
all experts on its own tokens, and reduce-scatters their gradients.

All-to-all share: under ep2 the token all-to-alls (dispatch and combine, forward and backward) and the counts
exchange are timed on each rank (until their result is ready, so waiting for the slower rank counts) and divided
by the step time.

Run at 8, 32 and 64 experts by default (the routed experts' FFN by grouped GEMM on both sides).

    python benchmarks/bench_moe.py [--repeats 2] [--steps 6] [--experts 8 32 64] [--width 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, os.path.dirname(__file__))
from common import StepTimer, interleaved, median, timed_trainer

import lightscale.parallel.experts as experts
from lightscale.layers.moe import MoEConfig
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.testing import run_distributed

MOE = MoEConfig(n_experts=8, top_k=2, balance="bias")
MODEL = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128, moe=MOE)
BATCH = 8  # per rank
WARMUP = 2
SPENT = [0.0]  # seconds inside all-to-alls on this rank


class TimedAllToAll(torch.autograd.Function):
    """``all_to_all_single_autograd`` with the time of its forward and backward collectives recorded."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits = (in_splits, out_splits, group)
        return _timed(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        in_splits, out_splits, group = ctx.splits
        return _timed(grad.contiguous(), in_splits, out_splits, group), None, None, None


def _timed(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    start = time.perf_counter()
    y = funcol.wait_tensor(funcol.all_to_all_single(x, out_splits, in_splits, group))
    SPENT[0] += time.perf_counter() - start
    return y


def _timed_counts(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    result = _ALL_TO_ALL(output, input, *args, **kwargs)
    SPENT[0] += time.perf_counter() - start
    return result


_ALL_TO_ALL = dist.all_to_all_single


class ShareTimer(StepTimer):
    """Step times and the all-to-all seconds of the same steps."""

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self.shares: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        SPENT[0] = 0.0
        super().on_train_batch_start(*args)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        super().on_train_batch_end(trainer, module, outputs, batch, idx)
        if idx >= self.warmup:
            self.shares.append(SPENT[0] / self.times[-1])


def _fit(strategy: str, steps: int, cache_dir: str) -> tuple[float, float]:
    experts.all_to_all_single_autograd = TimedAllToAll.apply
    dist.all_to_all_single = _timed_counts
    pl.seed_everything(0, verbose=False)
    timer = ShareTimer(WARMUP)
    trainer = timed_trainer(strategy, devices=2, steps=steps, callbacks=[timer])
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=BATCH, cache_dir=cache_dir)
    trainer.fit(GPTModule(MODEL, warmup_steps=1), data)
    return median(timer.times), median(timer.shares)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    from lightscale.recipes.gpt.data import ByteTokenizer, default_cache_dir, tokenize_to_memmap

    cache = str(default_cache_dir())
    tokenize_to_memmap(None, default_cache_dir(), ByteTokenizer())
    for n_experts in args.experts:
        _compare(n_experts, args.width, args.steps, args.repeats, cache)


def _compare(n_experts: int, width: int, steps: int, repeats: int, cache: str) -> None:
    global MOE, MODEL  # the forked ranks inherit them
    MOE = dataclasses.replace(MOE, n_experts=n_experts)
    MODEL = dataclasses.replace(MODEL, n_embd=width, moe=MOE)
    times: dict[str, list[float]] = {"ep2": [], "fsdp2": []}
    shares: list[float] = []
    for name in interleaved(list(times), repeats):
        ranks = run_distributed(_fit, name, steps + WARMUP, cache, world_size=2, timeout_s=600)
        times[name].append(max(rank[0] for rank in ranks))
        if name == "ep2":
            shares.append(sum(rank[1] for rank in ranks) / len(ranks))
    ep, fsdp = median(times["ep2"]), median(times["fsdp2"])
    print(
        f"bench_moe: GPT {MODEL.n_layer}x{MODEL.n_embd}, {MOE.n_experts} experts top-{MOE.top_k} in every block, "
        f"batch {BATCH}x{MODEL.block_size} per rank, 2 ranks: ep2 {ep * 1e3:.1f} ms/step, fsdp2 (experts sharded "
        f"like dense weights) {fsdp * 1e3:.1f} ms/step, ratio ep2/fsdp2 {ep / fsdp:.3f}; all-to-all share of the "
        f"ep2 step {median(shares):.1%}"
    )


if __name__ == "__main__":
    main()
