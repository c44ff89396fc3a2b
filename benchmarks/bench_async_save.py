"""Async save: how long one checkpoint save blocks the training loop, async ÷ synchronous, side by side in one run.

The small GPT under fsdp2 (``lightscale.Trainer``), 2 forked gloo ranks, fp32 + AdamW (model and Adam moments are
saved). Every ``--gap`` steps ``trainer.save_checkpoint`` runs, alternately synchronous (``checkpointer.writer``
None) and async (an ``AsyncCheckpointWriter``), in ABBA order, into two directories. Blocked time: the wall time of
the ``save_checkpoint`` call on rank 0. Before each save the previous async write is waited for outside the timed
span (its remaining time is reported as "background"), so a save never pays for the one before; with saves further
apart than a write takes, that wait is zero in a real run. Step times while a write is in flight are reported
beside those without: on a shared 2-core machine the side thread competes with training for the cores.

    python benchmarks/bench_async_save.py [--repeats 4] [--gap 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, median, timed_trainer

from lightscale.checkpoint.async_save import AsyncCheckpointWriter
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.strategies import FSDP2Strategy
from lightscale.testing import run_distributed

MODEL = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)  # the benchmarks' small GPT
WARMUP = 2


class SaveTimer(pl.Callback):
    """Saves every ``gap`` steps after warm-up, in ``order``; records blocked, background and step times."""

    def __init__(self, order: list[str], gap: int, directory: Path) -> None:
        self.order, self.gap, self.directory = order, gap, directory
        self.blocked: dict[str, list[float]] = {"sync": [], "async": []}
        self.background: list[float] = []
        self.steps: dict[str, list[float]] = {"writing": [], "idle": []}
        self.writer = AsyncCheckpointWriter()
        self._in_flight = False
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step > WARMUP:
            self.steps["writing" if self._in_flight else "idle"].append(time.perf_counter() - self._start)
        index = (step - WARMUP) // self.gap - 1
        if step <= WARMUP or (step - WARMUP) % self.gap or index >= len(self.order):
            return
        start = time.perf_counter()
        self.writer.wait()  # the previous async write: not part of this save's blocked time
        self.background.append(time.perf_counter() - start)
        mode = self.order[index]
        trainer.strategy.checkpointer.writer = self.writer if mode == "async" else None
        start = time.perf_counter()
        trainer.save_checkpoint(self.directory / f"{mode}.ckpt")
        self.blocked[mode].append(time.perf_counter() - start)
        self._in_flight = mode == "async"

    def on_train_end(self, *args: Any) -> None:
        self.writer.wait()


def _rank(repeats: int, gap: int, directory: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    order = interleaved(["sync", "async"], repeats)
    timer = SaveTimer(order, gap, Path(directory))
    steps = WARMUP + gap * (len(order) + 1)
    trainer = timed_trainer(FSDP2Strategy(), devices=2, steps=steps, callbacks=[timer])
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=4)
    trainer.fit(GPTModule(MODEL), data)
    bytes_on_disk = sum(f.stat().st_size for f in (Path(directory) / "sync.ckpt").rglob("*") if f.is_file())
    return {"blocked": timer.blocked, "background": timer.background, "steps": timer.steps, "bytes": bytes_on_disk}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--gap", type=int, default=3, help="training steps between saves")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        result = run_distributed(_rank, args.repeats, args.gap, directory, world_size=2, timeout_s=3000)[0]
    sync, asynchronous = median(result["blocked"]["sync"]), median(result["blocked"]["async"])
    print(
        f"async save, small GPT ({result['bytes'] / 2**20:.1f} MiB checkpoint), fsdp2, 2 CPU ranks, "
        f"{args.repeats} ABBA repeats, medians:"
    )
    print(f"  loop blocked by one save: sync {sync * 1e3:.0f} ms, async {asynchronous * 1e3:.0f} ms")
    print(f"  async blocked / sync save time: {asynchronous / sync:.3f} (target <= 0.2)")
    background = [b for b in result["background"] if b > 0.001]
    if background:
        print(f"  remaining background write when the next save came: median {median(background) * 1e3:.0f} ms")
    steps = result["steps"]
    if steps["writing"]:
        print(
            f"  step time while a write is in flight {median(steps['writing']) * 1e3:.0f} ms vs "
            f"{median(steps['idle']) * 1e3:.0f} ms without (the side thread shares the cores)"
        )


if __name__ == "__main__":
    main()
