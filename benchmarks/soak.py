"""Soak: a long run per strategy family shows whether host memory or step time grows with the step count.

The tiny GPT trains for ``--steps`` steps on 2 forked gloo ranks under bucketed_ddp, zero2, fsdp2 and tp2
(parallel_3d), one family after another. Every rank samples its resident set size (``/proc/self/statm``) and the
wall time from one batch start to the next at every step; after ``--warmup`` steps it prints the least-squares
slope of each, per rank: MiB per 1,000 steps and ms per 1,000 steps. A leak (a list that keeps every loss, a
hook registered per step, an unfreed communication buffer) shows as a positive RSS slope; a slope near 0 within
the noise of a shared machine is the pass. Not part of the test suite (minutes per family): ``make soak``.

    python benchmarks/soak.py [--steps 2000] [--warmup 200] [--strategies bucketed_ddp zero2 fsdp2 tp2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(__file__))
from common import timed_trainer

from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.testing import run_distributed

MODEL = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
FAMILIES = ["bucketed_ddp", "zero2", "fsdp2", "tp2"]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE / 2**20


class Samples(pl.Callback):
    """RSS at every step end and the time from one batch start to the next (data, step, hooks: everything)."""

    def __init__(self) -> None:
        self.rss: list[float] = []
        self.step_ms: list[float] = []
        self._last = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        now = time.perf_counter()
        if self._last:
            self.step_ms.append((now - self._last) * 1000)
        self._last = now

    def on_train_batch_end(self, *args: Any) -> None:
        self.rss.append(rss_mib())


def slope_per_1000(values: list[float]) -> float:
    """Least-squares slope of ``values`` against their index, scaled to a change per 1,000 steps."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values))
    variance = sum((x - mean_x) ** 2 for x in range(n))
    return 1000 * covariance / variance


def _rank(strategy: str, steps: int, warmup: int) -> dict[str, float]:
    pl.seed_everything(1234, verbose=False)
    samples = Samples()
    trainer = timed_trainer(strategy, devices=2, steps=steps, callbacks=[samples])
    trainer.fit(
        GPTModule(MODEL, learning_rate=3e-3, warmup_steps=5), GPTDataModule(block_size=MODEL.block_size, batch_size=4)
    )
    rss, step_ms = samples.rss[warmup:], samples.step_ms[warmup:]
    return {
        "rss_start": rss[0],
        "rss_end": rss[-1],
        "rss_slope": slope_per_1000(rss),
        "rss_slope_late": slope_per_1000(rss[len(rss) // 2 :]),  # a leak keeps its slope; allocator warm-up flattens
        "ms_median": sorted(step_ms)[len(step_ms) // 2],
        "ms_slope": slope_per_1000(step_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200, help="steps dropped before fitting the slopes")
    parser.add_argument("--strategies", nargs="+", default=FAMILIES)
    args = parser.parse_args()
    print(
        f"{'strategy':<13} rank  RSS MiB start->end  RSS slope MiB/1k steps (2nd half)  step ms median"
        "  step slope ms/1k steps"
    )
    for strategy in args.strategies:
        started = time.perf_counter()
        ranks = run_distributed(_rank, strategy, args.steps, args.warmup, world_size=2, timeout_s=3000)
        for rank, r in enumerate(ranks):
            print(
                f"{strategy:<13} {rank:>4}  {r['rss_start']:7.1f} -> {r['rss_end']:7.1f}  {r['rss_slope']:+22.2f}"
                f" ({r['rss_slope_late']:+6.2f})"
                f"  {r['ms_median']:14.1f}  {r['ms_slope']:+22.2f}",
                flush=True,
            )
        print(f"# {strategy}: {args.steps} steps in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
