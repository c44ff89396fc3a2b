"""MemoryProfiler's cost (step time with it measuring every step ÷ without) and the estimator's speed on a 7B GPT.

The overhead run trains the small GPT on 2 CPU ranks under fsdp2, with and without ``MemoryProfiler(every_n_steps=1)``
(its worst case: the default measures every ``log_every_n_steps``), interleaved ABBA in the same forked ranks; step
time is wall clock from one batch start to the next, so every callback's work is inside it. The estimate times are
the Python API on a freshly constructed 7B module and the ``lightscale estimate`` command end to end (imports
included).

    python benchmarks/bench_memory.py [--repeats 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch import Callback

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, median, timed_trainer

from lightscale.callbacks import MemoryProfiler
from lightscale.estimate import estimate_memory
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.testing import run_distributed

SMALL = GPTConfig(block_size=128, n_layer=6, n_head=6, n_embd=384)
SEVEN_B = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, tie_weights=False)
WARMUP = 2


class BatchToBatch(Callback):
    """Wall time between consecutive batch starts: the whole step with every callback's work in it."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last: float | None = None

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        now = time.perf_counter()
        if self._last is not None and trainer.global_step > WARMUP:
            self.times.append(now - self._last)
        self._last = now


def _fit(profiled: bool, steps: int) -> list[float]:
    pl.seed_everything(0, verbose=False)
    timer = BatchToBatch()
    callbacks: list[Callback] = [timer]
    if profiled:
        callbacks.append(MemoryProfiler(every_n_steps=1, out_dir=tempfile.mkdtemp(), plot=False, estimate=False))
    trainer = timed_trainer("fsdp2", devices=dist.get_world_size(), steps=WARMUP + steps + 1, callbacks=callbacks)
    trainer.fit(GPTModule(SMALL), GPTDataModule(block_size=SMALL.block_size, batch_size=4))
    return timer.times


def _rank(repeats: int, steps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"off": [], "on": []}
    for name in interleaved(list(times), repeats):
        times[name].extend(_fit(name == "on", steps))
    return times


def _estimate_times() -> tuple[float, float]:
    start = time.perf_counter()
    estimate_memory(GPTModule(SEVEN_B), "fsdp2", world_size=1024, precision="bf16-mixed", micro_batch=1)
    api = time.perf_counter() - start
    start = time.perf_counter()
    command = [
        sys.executable,
        "-m",
        "lightscale.cli",
        "estimate",
        "--config",
        "gpt/7b_fsdp2.yaml",
        "--world-size",
        "64",
    ]
    subprocess.run(command, check=True, capture_output=True)
    return api, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    api, command = _estimate_times()
    print(f"bench_memory: estimate of a 7B GPT (fsdp2, 1024 ranks): Python API {api:.2f} s, CLI {command:.2f} s")
    times = run_distributed(_rank, args.repeats, args.steps, world_size=2, timeout_s=3000)[0]
    off, on = median(times["off"]), median(times["on"])
    print(
        f"  MemoryProfiler(every_n_steps=1) on the small GPT, fsdp2, 2 ranks: step {on * 1e3:.0f} ms on / "
        f"{off * 1e3:.0f} ms off = ratio {on / off:.3f} (target < 1.05; {len(times['on'])} steps each, medians)"
    )


if __name__ == "__main__":
    main()
