"""bucketed_ddp vs Lightning's ``ddp`` (torch DistributedDataParallel): step time on the small GPT.

Both run in the same forked ranks, interleaved ABBA, several repeats; the ratio is of median step times.
Also prints the bytes all-reduced per step (all gradient bytes, once) and the ring traffic per rank,
2(N-1)/N of that.

    python benchmarks/bench_ddp.py [--ranks 2 4] [--repeats 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import StepTimer, interleaved, median, timed_trainer

from lightscale.recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTModule
from lightscale.testing import run_distributed

SMALL = GPTConfig(block_size=128, n_layer=6, n_head=6, n_embd=384)
WARMUP = 2


def _fit(strategy: str, steps: int, batch_size: int) -> list[float]:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(WARMUP)
    trainer = timed_trainer(strategy, devices=dist.get_world_size(), steps=WARMUP + steps, callbacks=[timer])
    trainer.fit(GPTModule(SMALL), GPTDataModule(block_size=SMALL.block_size, batch_size=batch_size))
    return timer.times


def _rank(repeats: int, steps: int, batch_size: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"ddp": [], "bucketed_ddp": []}
    for name in interleaved(list(times), repeats):
        times[name].extend(_fit(name, steps, batch_size))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    grad_bytes = 4 * GPT(SMALL).num_params()
    print(f"bench_ddp: small GPT ({grad_bytes // 4:,} params, block {SMALL.block_size}, batch {args.batch_size}/rank)")
    for ranks in args.ranks:
        times = run_distributed(_rank, args.repeats, args.steps, args.batch_size, world_size=ranks, timeout_s=3000)[0]
        ddp, ours = median(times["ddp"]), median(times["bucketed_ddp"])
        ring = 2 * (ranks - 1) / ranks * grad_bytes
        print(
            f"  {ranks} ranks: step time bucketed_ddp {ours * 1e3:.0f} ms / ddp {ddp * 1e3:.0f} ms = "
            f"ratio {ours / ddp:.3f} (target <= 1.00; {len(times['ddp'])} steps each, medians)"
        )
        print(
            f"           all-reduced per step {grad_bytes:,} B (all gradients once); "
            f"ring traffic per rank 2(N-1)/N x that = {ring:,.0f} B"
        )


if __name__ == "__main__":
    main()
