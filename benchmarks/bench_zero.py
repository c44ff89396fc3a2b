"""zero3_offload through lightscale vs a raw DeepSpeed engine loop with the same config: step time on a GPT.

Both sides use the engine config lightscale generates (``build_config``), the same GPT (same seed), the same
batches (the GPTDataModule's train loader, sharded by rank) and the same optimizer: the module's AdamW turned
into DeepSpeed's CPU Adam (``cpu_adam_from``) with its LR schedule. Only the loop around the engine differs:
Lightning's (hooks, closure, logging) vs ``engine(x)``; ``engine.backward(loss)``; ``engine.step()``.
Both run in the same 2 forked gloo ranks, interleaved ABBA, several repeats; warm-up steps are dropped and the
ratio is of median step times. Rank 0's per-step losses are compared to show both sides did the same work.

    python benchmarks/bench_zero.py [--repeats 4] [--steps 5] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

# DeepSpeed JIT-builds CPU Adam once per virtual environment; reuse that build (as ZeroStrategy does).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import lightning.pytorch as pl
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import LossStepTimer, interleaved, median, stub_trainer, timed_trainer

from lightscale.recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTModule
from lightscale.strategies.deepspeed.config import ZeroOptions, build_config
from lightscale.strategies.deepspeed.engine import cpu_adam_from
from lightscale.testing import run_distributed

MODEL = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)
OPTIONS = ZeroOptions(stage=3, offload_optimizer=True, offload_params=True)  # what "zero3_offload" means
PRECISION = "32-true"
WARMUP = 2


def _lightscale(steps: int, batch_size: int) -> tuple[list[float], list[float]]:
    pl.seed_everything(0, verbose=False)
    timer = LossStepTimer(WARMUP)
    trainer = timed_trainer(
        "zero3_offload", devices=dist.get_world_size(), steps=WARMUP + steps, callbacks=[timer], precision=PRECISION
    )
    trainer.fit(GPTModule(MODEL), GPTDataModule(block_size=MODEL.block_size, batch_size=batch_size))
    return timer.times, timer.losses


def _raw(steps: int, batch_size: int) -> tuple[list[float], list[float]]:
    import deepspeed

    deepspeed.init_distributed("gloo", dist_init_required=False)
    pl.seed_everything(0, verbose=False)
    stub = stub_trainer(WARMUP + steps)
    config = build_config(
        OPTIONS, micro_batch_size=batch_size, accumulate=1, gradient_clip_val=None, precision=PRECISION
    )
    module = GPTModule(MODEL)
    with deepspeed.zero.Init(config_dict_or_path=config):  # as ZeroStrategy.model_sharded_context does
        module.configure_model()
    module.trainer = stub  # type: ignore[assignment]
    configured = module.configure_optimizers()
    module.trainer = None
    optimizer = cpu_adam_from(configured["optimizer"])
    scheduler = configured["lr_scheduler"]["scheduler"]
    scheduler.optimizer = optimizer  # as ZeroStrategy.setup does
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=batch_size)
    data.trainer = stub  # type: ignore[assignment]
    data.setup("fit")
    engine, *_ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        optimizer=optimizer,
        config=config,
        dist_init_required=False,
    )
    engine.train()
    times: list[float] = []
    losses: list[float] = []
    for step, (tokens, targets) in enumerate(islice(data.train_dataloader(), WARMUP + steps)):
        start = time.perf_counter()
        logits = engine(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        engine.backward(loss)
        engine.step()
        scheduler.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    engine.destroy()
    return times, losses


def _rank(repeats: int, steps: int, batch_size: int) -> dict[str, Any]:
    runs = {"raw_deepspeed": _raw, "zero3_offload": _lightscale}
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {}
    for name in interleaved(list(runs), repeats):
        step_times, losses[name] = runs[name](steps, batch_size)
        times[name].extend(step_times)
    return {"times": times, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    params = GPT(MODEL).num_params()
    print(
        f"bench_zero: zero3_offload on 2 CPU ranks, GPT {params:,} params (block {MODEL.block_size}, "
        f"{MODEL.n_layer} layers, width {MODEL.n_embd}), batch {args.batch_size}/rank, {PRECISION}, CPU Adam"
    )
    result = run_distributed(_rank, args.repeats, args.steps, args.batch_size, world_size=2, timeout_s=3000)[0]
    times, losses = result["times"], result["losses"]
    raw, ours = median(times["raw_deepspeed"]), median(times["zero3_offload"])
    print(
        f"  step time lightscale zero3_offload {ours * 1e3:.0f} ms / raw DeepSpeed engine loop {raw * 1e3:.0f} ms "
        f"= ratio {ours / raw:.3f} (target <= 1.05; {len(times['raw_deepspeed'])} steps each, medians)"
    )
    gap = max(abs(a - b) for a, b in zip(losses["zero3_offload"], losses["raw_deepspeed"], strict=True))
    print(f"  same work: rank-0 losses over {len(losses['raw_deepspeed'])} steps differ by at most {gap:.2e}")


if __name__ == "__main__":
    main()
