"""The CLIP recipe's loss + step (lightscale.Trainer, bucketed_ddp) vs a hand-written torch DDP loop with open_clip's
``ClipLoss(local_loss=True, gather_with_grad=True)``: same model, weights, batches and optimizer.

First the losses of both, step by step (they must agree: the same global-batch loss), then samples/s and the
ratio of median step times, ABBA-interleaved. open_clip is loaded from ``--open-clip-path`` (default
/tmp/openclip) without its dependencies, because ``pip install open_clip_torch`` pulls a CUDA torch of another
version; only its ``loss.py`` is imported (it needs nothing but torch):

    pip install --no-deps --target /tmp/openclip open_clip_torch
    python benchmarks/bench_clip.py [--ranks 2] [--repeats 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
from common import LossStepTimer, interleaved, median, stub_trainer, timed_trainer

from lightscale.parallel.contrastive import clip_loss
from lightscale.recipes.clip import CLIP, CLIPConfig, CLIPDataModule, CLIPModule, TextConfig
from lightscale.recipes.vit.model import ViTConfig
from lightscale.testing import run_distributed

CONFIG = CLIPConfig(
    vision=ViTConfig.named("small", num_classes=0), text=TextConfig(n_layer=2, n_head=2, n_embd=64), embed_dim=64
)
WARMUP = 2
LR = 5e-4


def load_open_clip_loss(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("open_clip_loss", Path(path) / "open_clip" / "loss.py")
    if spec is None or spec.loader is None or not spec.origin or not Path(spec.origin).is_file():
        raise SystemExit(f"open_clip not found under {path}: pip install --no-deps --target {path} open_clip_torch")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BenchCLIP(CLIPModule):
    """The recipe's module with a constant-rate AdamW, so a hand-written loop can use the very same optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0)


def data(batch_size: int) -> CLIPDataModule:
    dm = CLIPDataModule(batch_size=batch_size)
    dm.setup("fit")
    return dm


def run_lightscale(steps: int, batch_size: int) -> tuple[list[float], list[float]]:
    pl.seed_everything(0, verbose=False)
    module = BenchCLIP(CONFIG)
    module.configure_model()  # built here, after the seed, exactly as the hand-written loop builds it
    timer = LossStepTimer(WARMUP)
    trainer = timed_trainer("bucketed_ddp", devices=dist.get_world_size(), steps=WARMUP + steps, callbacks=[timer])
    trainer.fit(module, CLIPDataModule(batch_size=batch_size))
    return timer.times, timer.losses


def open_clip_loss(path: str) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    loss = load_open_clip_loss(path).ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    return lambda out: loss(out.image, out.text, out.logit_scale)


def lightscale_loss(out: Any) -> torch.Tensor:
    return clip_loss(out.image, out.text, out.logit_scale, group=dist.group.WORLD)


def run_ddp_loop(steps: int, batch_size: int, loss_fn: Any) -> tuple[list[float], list[float]]:
    """A hand-written torch DDP loop around ``loss_fn(CLIPOutput)``."""
    pl.seed_everything(0, verbose=False)
    model = DistributedDataParallel(CLIP(CONFIG))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    dm = data(batch_size)
    dm.trainer = stub_trainer(WARMUP + steps)
    times, losses = [], []
    for step, (images, tokens, _) in zip(range(WARMUP + steps), dm.train_dataloader(), strict=False):
        start = time.perf_counter()
        out = model(images, tokens)
        loss = loss_fn(out)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses


def _rank(repeats: int, steps: int, batch_size: int, open_clip_path: str) -> dict[str, Any]:
    runs = {
        "lightscale": lambda: run_lightscale(steps, batch_size),
        "open_clip": lambda: run_ddp_loop(steps, batch_size, open_clip_loss(open_clip_path)),
        "lightscale_loss_in_ddp_loop": lambda: run_ddp_loop(steps, batch_size, lightscale_loss),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    losses: dict[str, list[float]] = {}
    for name in interleaved(list(runs), repeats):
        step_times, losses[name] = runs[name]()
        times[name].extend(step_times)
    return {"times": times, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--open-clip-path", default="/tmp/openclip")
    args = parser.parse_args()
    if not (Path(args.open_clip_path) / "open_clip" / "loss.py").is_file():  # make bench runs on without it
        print(
            f"bench_clip: skipped, open_clip not found: pip install --no-deps --target {args.open_clip_path} "
            "open_clip_torch"
        )
        return
    print(f"bench_clip: small CLIP, {args.ranks} ranks x {args.batch_size} pairs, AdamW")
    results = run_distributed(
        _rank, args.repeats, args.steps, args.batch_size, args.open_clip_path, world_size=args.ranks, timeout_s=3000
    )
    # Each rank's loss is its share; the mean over ranks is the global-batch loss (open_clip's local_loss too).
    mean = {
        n: [sum(v) / len(v) for v in zip(*(r["losses"][n] for r in results), strict=True)] for n in results[0]["losses"]
    }
    worst = max(abs(a - b) / abs(b) for a, b in zip(mean["lightscale"], mean["open_clip"], strict=True))
    print(f"  losses, mean over ranks: lightscale {[round(x, 4) for x in mean['lightscale']]}")
    print(
        f"                           open_clip  {[round(x, 4) for x in mean['open_clip']]}  (max rel diff {worst:.1e})"
    )
    times = results[0]["times"]
    ours, theirs, loss_only = (median(times[n]) for n in ("lightscale", "open_clip", "lightscale_loss_in_ddp_loop"))
    global_batch = args.ranks * args.batch_size
    print(
        f"  samples/s lightscale {global_batch / ours:,.0f} / open_clip+DDP {global_batch / theirs:,.0f}; step time "
        f"ratio {ours / theirs:.3f} (target <= 1.05; medians of {len(times['open_clip'])} steps)"
    )
    print(f"  the loss alone: lightscale's clip_loss in the same DDP loop / open_clip's = {loss_only / theirs:.3f}")


if __name__ == "__main__":
    main()
