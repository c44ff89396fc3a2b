"""Checkpoints in object storage: one save to a local S3 server ÷ one save to local disk, side by side in one run.

The small GPT under fsdp2 (``lightscale.Trainer``), 2 forked gloo ranks, fp32 + AdamW (model and Adam moments are
saved). Every ``--gap`` steps ``trainer.save_checkpoint`` runs, in ABBA order, to one of: a local directory
(``local``, a new name each time), ``s3://`` on a moto server on loopback (lightscale/testing/local_s3.py) under a new
name each time (``s3 new``: ModelCheckpoint's ``step=N.ckpt``; written in place, completed by the marker), and
``s3://`` over the same ``last.ckpt`` (``s3 over``: staged under ``last.ckpt.tmp/``, then copied server-side behind
the marker). Save time: the wall time of the ``save_checkpoint`` call on rank 0 (every rank's shards written, the
atomic commit done). The server runs on the same 2-core machine, so its CPU time competes with the ranks': a real
object store's network replaces it.

``--format deepspeed`` saves DeepSpeed's own engine directory instead (a ZeRO strategy with
``checkpoint_format="deepspeed"``: each rank writes to local scratch and uploads its files; lightscale/zero/
checkpoint_dir.py).

    python benchmarks/s3_save.py [--repeats 3] [--gap 2] [--strategy fsdp2]
    python benchmarks/s3_save.py --strategy zero2 --format deepspeed
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(__file__))
from common import interleaved, median, timed_trainer

from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.strategies import ZeroStrategy
from lightscale.testing import run_distributed
from lightscale.testing.local_s3 import local_s3_server, s3_environment

MODEL = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)  # the benchmarks' small GPT
WARMUP = 2
BUCKET = "bench-checkpoints"
TARGETS = ("local", "s3 new", "s3 over")


class SaveTimer(pl.Callback):
    """Saves every ``gap`` steps after warm-up to the target ``order`` names; records each save's wall time."""

    def __init__(self, order: list[str], gap: int, targets: dict[str, str]) -> None:
        self.order, self.gap, self.targets = order, gap, targets
        self.seconds: dict[str, list[float]] = {name: [] for name in targets}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if step == WARMUP:  # one untimed save per target: clients and connections set up, as in a run's later saves
            for where, target in self.targets.items():
                trainer.save_checkpoint(f"{target}/{'last' if where == 's3 over' else 'warmup'}.ckpt")
        index = (step - WARMUP) // self.gap - 1
        if step <= WARMUP or (step - WARMUP) % self.gap or index >= len(self.order):
            return
        where = self.order[index]
        name = "last" if where == "s3 over" else f"step={step}"
        start = time.perf_counter()
        trainer.save_checkpoint(f"{self.targets[where]}/{name}.ckpt")
        self.seconds[where].append(time.perf_counter() - start)


def _strategy(name: str, checkpoint_format: str) -> Any:
    """The strategy name, or for ``--format deepspeed`` that ZeRO name's class writing DeepSpeed's own directory."""
    if checkpoint_format == "dcp":
        return name
    _, init = ZeroStrategy.aliases[name]  # KeyError: only ZeRO names write DeepSpeed's format
    return ZeroStrategy(**init, checkpoint_format=checkpoint_format)


def _rank(strategy: str, checkpoint_format: str, repeats: int, gap: int, directory: str) -> dict[str, list[float]]:
    pl.seed_everything(0, verbose=False)
    order = interleaved(list(TARGETS), repeats)
    targets = {"local": directory, "s3 new": f"s3://{BUCKET}/new", "s3 over": f"s3://{BUCKET}/over"}
    timer = SaveTimer(order, gap, targets)
    steps = WARMUP + gap * (len(order) + 1)
    trainer = timed_trainer(_strategy(strategy, checkpoint_format), devices=2, steps=steps, callbacks=[timer])
    trainer.fit(GPTModule(MODEL), GPTDataModule(block_size=MODEL.block_size, batch_size=4))
    return timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gap", type=int, default=2, help="training steps between saves")
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--format", default="dcp", choices=["dcp", "deepspeed"], help="deepspeed: a ZeRO name")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory, local_s3_server(bucket=BUCKET) as endpoint:
        os.environ.update(s3_environment(endpoint))  # the ranks' S3 clients (forked: they inherit it)
        run = (args.strategy, args.format, args.repeats, args.gap, directory)
        seconds = run_distributed(_rank, *run, world_size=2, timeout_s=3000)
        first = next(Path(directory).glob("step=*.ckpt"))
        size = sum(f.stat().st_size for f in first.rglob("*") if f.is_file())
        s3_size = sum(fsspec.filesystem("s3").du(f"{BUCKET}/over/last.ckpt", total=False).values())
    times = {name: median(seconds[0][name]) for name in TARGETS}
    print(
        f"checkpoint save to S3 (moto on loopback) vs local disk, small GPT ({size / 2**20:.1f} MiB checkpoint, "
        f"{s3_size / 2**20:.1f} MiB in the bucket), {args.strategy} ({args.format}), 2 CPU ranks, {args.repeats} ABBA "
        "repeats, medians:"
    )
    print("  one save: " + ", ".join(f"{name} {value * 1e3:.0f} ms" for name, value in times.items()))
    every = {name: " ".join(f"{t * 1e3:.0f}" for t in seconds[0][name]) for name in TARGETS}
    print("  every save (ms): " + "; ".join(f"{name} {values}" for name, values in every.items()))
    print(
        f"  S3 / local save time: new name {times['s3 new'] / times['local']:.2f}, "
        f"over last.ckpt {times['s3 over'] / times['local']:.2f}"
    )


if __name__ == "__main__":
    main()
