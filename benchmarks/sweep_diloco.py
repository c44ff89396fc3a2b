"""DiLoCo's outer learning rate x momentum x H, against DDP and local SGD at the same tokens: `make bench-diloco`.

The small GPT of ``gpt/small_ddp.yaml`` (its model, learning rate, warmup, batch and block size) on 4 workers x 1
rank; every run sees the same tokens. Prints one markdown table (final validation loss of the global model, its gap
to DDP, and whether it beats local SGD at the same H) and writes every curve to ``--out`` (JSON). The full grid takes
hours on a CPU machine: run it alone. ``--quick`` is a sanity run (the tiny GPT, a few steps, a corner of the grid).

    python benchmarks/sweep_diloco.py [--steps 1500] [--val-every 100] [--out sweep_diloco.json]
    python benchmarks/sweep_diloco.py --quick
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from bench_diloco import CONFIG, WORKERS, _train

from lightscale.recipes.gpt import GPTConfig
from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap
from lightscale.testing import run_distributed

RECIPE = Path(__file__).resolve().parents[1] / "lightscale" / "recipes" / "gpt" / "configs" / "small_ddp.yaml"
SYNC_EVERY = (10, 30, 100)
OUTER_LR = (0.3, 0.5, 0.7, 1.0)
OUTER_MOMENTUM = (0.0, 0.5, 0.9)


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


def grid(quick: bool) -> dict[str, dict[str, Any] | None]:
    """Run name -> DiLoCoStrategy settings (None: DDP)."""
    hs, lrs, momenta = ((10,), (0.7, 1.0), (0.0, 0.9)) if quick else (SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM)
    runs: dict[str, dict[str, Any] | None] = {"DDP": None}
    for h in hs:
        runs[f"local SGD H={h}"] = {"sync_every": h, "mode": "local_sgd"}
        for lr, momentum in itertools.product(lrs, momenta):
            runs[f"DiLoCo H={h} lr={lr} m={momentum}"] = {"sync_every": h, "outer_lr": lr, "outer_momentum": momentum}
    return runs


def table(results: dict[str, dict[str, Any]]) -> str:
    ddp = results["DDP"]["curve"][-1][1]
    lines = ["| run | final val loss | vs DDP | beats local SGD (same H) |", "|---|---|---|---|"]
    for name, result in results.items():
        loss = result["curve"][-1][1]
        h = name.split("H=")[1].split()[0] if "H=" in name else None
        local = results.get(f"local SGD H={h}") if name.startswith("DiLoCo") else None
        beats = "" if local is None else ("yes" if loss < local["curve"][-1][1] else "no")
        lines.append(f"| {name} | {loss:.4f} | {100 * (loss / ddp - 1):+.1f} % | {beats} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--val-every", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, 20 steps, a corner of the grid")
    parser.add_argument("--out", default="sweep_diloco.json")
    parser.add_argument("--cache", default="/tmp/lightscale_bench_diloco_corpus")
    args = parser.parse_args()
    settings = {"config": CONFIG, "val_batches": 2} if args.quick else {**recipe_settings(), "val_batches": 8}
    steps, val_every = (20, 10) if args.quick else (args.steps, args.val_every)
    tokenize_to_memmap(None, Path(args.cache), ByteTokenizer())  # once, before the ranks start
    results = {}
    for name, strategy in grid(args.quick).items():
        start = time.perf_counter()
        results[name] = run_distributed(
            _train, strategy, steps, val_every, args.cache, world_size=WORKERS, timeout_s=24 * 3600, **settings
        )[0]
        print(f"{name}: {results[name]['curve'][-1][1]:.4f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        Path(args.out).write_text(json.dumps({n: r["curve"] for n, r in results.items()}))  # a partial sweep survives
    print(table(results))


if __name__ == "__main__":
    main()
