"""Two "datacenters" on one machine joined by a slow link: step time of synchronous DDP ÷ DiLoCo at that bandwidth.

Two workers of one rank each (the tiny GPT, fp32, AdamW inside), every collective followed by the time its ring
traffic would take on the link (lightscale.measure.comm_counter.SlowLink: no overlap of communication with compute).
Both sides train the same steps, interleaved A B B A; the figure is the mean step time (DiLoCo's syncs included),
warm-up steps dropped.

    python benchmarks/bench_slow_link.py [--mbytes-per-second 10] [--steps 60] [--repeats 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from common import StepTimer, interleaved, median, timed_trainer

from lightscale.measure.comm_counter import SlowLink
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap
from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy
from lightscale.testing import run_distributed

CONFIG = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
SYNC_EVERY = 50
WARMUP = 5


def _strategy(name: str) -> pl.strategies.Strategy:
    return BucketedDDPStrategy() if name == "DDP" else DiLoCoStrategy(workers=2, sync_every=SYNC_EVERY)


def _train(name: str, steps: int, bytes_per_second: float, cache: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(WARMUP)
    trainer = timed_trainer(_strategy(name), devices=2, steps=steps, callbacks=[timer])
    data = GPTDataModule(block_size=CONFIG.block_size, batch_size=8, cache_dir=cache)
    with SlowLink(bytes_per_second=bytes_per_second, ranks=2) as link:
        trainer.fit(GPTModule(CONFIG, learning_rate=3e-3), data)
    return {
        "step_s": sum(timer.times) / len(timer.times),
        "waited_s": link.seconds_waited,
        "bytes": sum(c.bytes for c in link.calls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes-per-second", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=2 * SYNC_EVERY + WARMUP)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", default="/tmp/lightscale_bench_slow_link_corpus")
    args = parser.parse_args()
    tokenize_to_memmap(None, Path(args.cache), ByteTokenizer())  # once, before the ranks start
    rate = args.mbytes_per_second * 1e6
    runs: dict[str, list[dict[str, Any]]] = {"DDP": [], "DiLoCo": []}
    for name in interleaved(list(runs), args.repeats):
        runs[name].append(run_distributed(_train, name, args.steps, rate, args.cache, world_size=2, timeout_s=900)[0])
    step = {name: median([r["step_s"] for r in results]) for name, results in runs.items()}
    sent = {name: results[0]["bytes"] for name, results in runs.items()}
    print(f"link {args.mbytes_per_second:g} MB/s, 2 workers x 1 rank, {args.steps} steps, DiLoCo H={SYNC_EVERY}")
    print(f"{'method':<8} {'mean step':>12} {'bytes sent':>12} {'link wait':>10}")
    for name, results in runs.items():
        print(f"{name:<8} {step[name] * 1e3:>10.1f} ms {sent[name]:>12,} {results[0]['waited_s']:>8.2f} s")
    print(f"DDP / DiLoCo step time: {step['DDP'] / step['DiLoCo']:.2f}; bytes: {sent['DDP'] / sent['DiLoCo']:.1f}")


if __name__ == "__main__":
    main()
