"""DiLoCo's learning figure on CPU: the tiny GPT on 4 workers x 1 rank, the same tokens under every method.

Synchronous DDP (``bucketed_ddp``) against local SGD, DiLoCo (its default outer step and the paper's) and streaming
DiLoCo at H = 30, DiLoCo at H = 100, and DiLoCo and streaming DiLoCo at H = 30 after 150 synchronous steps:
the validation loss of the global model every ``--val-every`` steps, its last value, and the bytes each rank handed
to collectives in training steps (CommMonitor's count) divided by DDP's. Writes docs/images/diloco_curves.png.

    python benchmarks/bench_diloco.py [--steps 600] [--val-every 100]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

from lightscale.callbacks import CommMonitor
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap
from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy
from lightscale.testing import run_distributed

CONFIG = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
WORKERS = 4
BATCH = 8  # per rank
RUNS: dict[str, dict[str, Any] | None] = {
    "DDP": None,
    "local SGD H=30": {"sync_every": 30, "mode": "local_sgd"},
    "DiLoCo H=30": {"sync_every": 30},
    "DiLoCo H=30, the paper's outer step": {"sync_every": 30, "outer_lr": 0.7, "outer_momentum": 0.9},
    "streaming DiLoCo H=30 (3 fragments, overlap 1)": {"sync_every": 30, "fragments": 3, "overlap_steps": 1},
    "DiLoCo H=100": {"sync_every": 100},
    "DiLoCo H=30, the first 150 steps synchronous": {"sync_every": 30, "synchronous_steps": 150},
    "streaming DiLoCo H=30, the first 150 steps synchronous": {
        "sync_every": 30,
        "fragments": 3,
        "overlap_steps": 1,
        "synchronous_steps": 150,
    },
}
IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "diloco_curves.png"
RECIPE = Path(__file__).resolve().parents[1] / "lightscale" / "recipes" / "gpt" / "configs" / "small_ddp.yaml"


def synchronous_steps_for(share: float, steps: int, sync_every: int) -> int:
    """``share`` of a run's ``steps`` in whole rounds of ``sync_every``: how long a synchronous start runs."""
    return round(share * steps / sync_every) * sync_every


def recipe_settings() -> dict[str, Any]:
    """The small GPT's model and data settings, read from the shipped recipe (one source of truth)."""
    recipe = yaml.safe_load(RECIPE.read_text())
    model, data = recipe["model"]["init_args"], recipe["data"]["init_args"]
    return {
        "config": GPTConfig(**model["config"]),
        "learning_rate": model["learning_rate"],
        "warmup_steps": model["warmup_steps"],
        "batch": data["batch_size"],
    }


class ValLosses(pl.Callback):
    def __init__(self) -> None:
        self.curve: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.curve.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


def _train(
    settings: dict[str, Any] | None,
    steps: int,
    val_every: int,
    cache: str,
    *,
    config: GPTConfig = CONFIG,
    learning_rate: float = 3e-3,
    warmup_steps: int = 20,
    batch: int = BATCH,
    val_batches: int = 8,
    text_files: list[str] | None = None,
) -> dict[str, Any]:
    """One run on ``WORKERS`` ranks (DDP when ``settings`` is None); ``config`` and the rest: the model and data."""
    pl.seed_everything(0, verbose=False)
    strategy = BucketedDDPStrategy() if settings is None else DiLoCoStrategy(workers=WORKERS, **settings)
    monitor, losses = CommMonitor(every_n_steps=1, min_bytes=9), ValLosses()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORKERS,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=val_every,
        limit_val_batches=val_batches,
        check_val_every_n_epoch=None,
        callbacks=[monitor, losses],
    )
    module = GPTModule(config, learning_rate=learning_rate, warmup_steps=warmup_steps)
    data = GPTDataModule(text_files, block_size=config.block_size, batch_size=batch, cache_dir=cache)
    trainer.fit(module, data)
    sent = sum(t.bytes for step in monitor.records for kind, t in step.items() if kind in ("all_reduce", "all_gather"))
    return {"curve": losses.curve, "bytes": sent}


def plot(results: dict[str, dict[str, Any]], image: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        steps, values = zip(*result["curve"], strict=True)
        ax.plot(steps, values, marker="o", markersize=3, label=name)
    ax.set(xlabel="optimizer step", ylabel="validation loss (global model)", title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    image.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(image, dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--cache", default="/tmp/lightscale_bench_diloco_corpus")
    args = parser.parse_args()
    tokenize_to_memmap(None, Path(args.cache), ByteTokenizer())  # once, before the ranks start
    results = {}
    for name, settings in RUNS.items():
        start = time.perf_counter()
        results[name] = run_distributed(
            _train, settings, args.steps, args.val_every, args.cache, world_size=WORKERS, timeout_s=900
        )[0]
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    ddp_bytes = results["DDP"]["bytes"]
    print(f"{'method':<48} {'final val loss':>14} {'bytes / DDP':>12}")
    for name, result in results.items():
        print(f"{name:<48} {result['curve'][-1][1]:>14.4f} {result['bytes'] / ddp_bytes:>12.4f}")
    print(json.dumps({name: r["curve"] for name, r in results.items()}))
    plot(results, IMAGE, "tiny GPT, 4 workers x 1 rank")


if __name__ == "__main__":
    main()
