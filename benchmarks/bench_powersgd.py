"""PowerSGD vs uncompressed bucketed_ddp on the tiny GPT: loss after N steps and bytes all-reduced per step.

Same seed, data and AdamW schedule on both sides; the bytes are counted by the CommMonitor callback on an
optimizer step after warm-up (exact), the theory is 4(n + m)r per matrix plus the vectors uncompressed.

    python benchmarks/bench_powersgd.py [--steps 100] [--ranks 2] [--ranks-pq 1 4] [--warmup 10]
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch import Callback

import lightscale
from lightscale.callbacks import CommMonitor
from lightscale.parallel.powersgd import compressed_bytes
from lightscale.recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTModule
from lightscale.strategies.ddp.strategy import BucketedDDPStrategy
from lightscale.testing import run_distributed

TINY = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)  # lightscale/recipes/gpt/configs/tiny_ddp.yaml
LAST = 10  # the loss reported: mean of the last LAST steps, over ranks


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: object, outputs: dict, *args: object) -> None:
        self.losses.append(float(outputs["loss"]))  # this rank's batch


def _fit(rank: int, warmup: int, steps: int, batch_size: int) -> tuple[float, int]:
    pl.seed_everything(1234, verbose=False)
    compression = {"compression": "powersgd", "powersgd_rank": rank, "powersgd_warmup_steps": warmup} if rank else {}
    monitor, losses = CommMonitor(every_n_steps=1, min_bytes=9), Losses()  # min_bytes: drop Lightning's scalars
    trainer = lightscale.Trainer(
        strategy=BucketedDDPStrategy(**compression),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[monitor, losses],
    )
    module = GPTModule(TINY, learning_rate=3e-3, warmup_steps=5)
    trainer.fit(module, GPTDataModule(block_size=TINY.block_size, batch_size=batch_size))
    return sum(losses.losses[-LAST:]) / LAST, monitor.records[-1]["all_reduce"].bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ranks-pq", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    model = GPT(TINY)
    print(
        f"bench_powersgd: tiny GPT ({model.num_params():,} params), {args.ranks} ranks, {args.steps} steps, "
        f"batch {args.batch_size}/rank, AdamW 3e-3; loss = mean of the last {LAST} steps"
    )
    results = {}
    for rank in [0, *args.ranks_pq]:
        per_rank = run_distributed(
            _fit, rank, args.warmup, args.steps, args.batch_size, world_size=args.ranks, timeout_s=3000
        )
        results[rank] = (sum(loss for loss, _ in per_rank) / len(per_rank), per_rank[0][1])
    loss0, bytes0 = results[0]
    print(f"  uncompressed: loss {loss0:.4f}, {bytes0:,} bytes all-reduced per step")
    for rank in args.ranks_pq:
        loss, nbytes = results[rank]
        theory = compressed_bytes(model.parameters(), rank)
        print(
            f"  powersgd rank {rank} (warm-up {args.warmup}): loss {loss:.4f} ({loss / loss0:.3f} x uncompressed), "
            f"{nbytes:,} bytes per step = {nbytes / bytes0:.4f} of uncompressed (theory {theory / bytes0:.4f})"
        )


if __name__ == "__main__":
    main()
