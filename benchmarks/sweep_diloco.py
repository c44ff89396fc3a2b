"""DiLoCo's outer learning rate x momentum x H, against DDP and local SGD at the same tokens: `make bench-diloco`.

``--model small``: the small GPT of ``gpt/small_ddp.yaml`` (its model, learning rate, warmup, batch and block
size); ``--model tiny`` (the default): bench_diloco's tiny GPT, the one a 2-core machine can sweep. 4 workers x 1 rank;
every run sees the same tokens. Outer lr 1 without momentum is local SGD itself, so the grid runs it once under that
name; settings whose steady outer step (lr / (1 - momentum)) exceeds 10x the workers' mean delta are left out.
Then DiLoCo with its default outer step after a synchronous start of 5-30 % of the steps (``synchronous_steps``).
Prints one markdown table (final validation loss of the global model, its gap to DDP, whether it beats local SGD
at the same H, bytes ÷ DDP) and writes every run to ``--out`` (JSON) after each run. Run it alone: the grid takes about
an hour and a half on 2 CPU cores. ``--quick`` is a sanity run (a few steps, a corner of the grid).

    python benchmarks/sweep_diloco.py [--model tiny|small] [--steps 2000] [--val-every 250] [--out sweep_diloco.json]
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

from bench_diloco import CONFIG, WORKERS, _train, recipe_settings, synchronous_steps_for

from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap
from lightscale.testing import run_distributed

SYNC_EVERY = (30, 10, 100)  # H=30 first: the setting the targets are stated at
OUTER_LR = (0.4, 0.7, 1.0, 1.3)
OUTER_MOMENTUM = (0.0, 0.5, 0.9)
MAX_STEADY_STEP = 10.0  # lr / (1 - momentum): the outer step's size once momentum has built up
SYNCHRONOUS_SHARES = (0.05, 0.1, 0.2, 0.3)  # of the run's steps, synchronous before the workers part


def grid(quick: bool, steps: int) -> dict[str, dict[str, Any] | None]:
    """Run name -> DiLoCoStrategy settings (None: DDP)."""
    hs, lrs, momenta = ((10,), (0.7, 1.0), (0.0, 0.9)) if quick else (SYNC_EVERY, OUTER_LR, OUTER_MOMENTUM)
    runs: dict[str, dict[str, Any] | None] = {"DDP": None}
    for h in hs:
        runs[f"local SGD H={h}"] = {"sync_every": h, "mode": "local_sgd"}
        for lr, momentum in itertools.product(lrs, momenta):
            if (lr == 1.0 and momentum == 0.0) or lr / (1 - momentum) > MAX_STEADY_STEP:
                continue
            runs[f"DiLoCo H={h} lr={lr} m={momentum}"] = {"sync_every": h, "outer_lr": lr, "outer_momentum": momentum}
    for h, share in itertools.product(hs, () if quick else SYNCHRONOUS_SHARES):
        synchronous = synchronous_steps_for(share, steps, h)
        runs[f"DiLoCo H={h} default, {synchronous} synchronous steps"] = {
            "sync_every": h,
            "synchronous_steps": synchronous,
        }
    return runs


def table(results: dict[str, dict[str, Any]]) -> str:
    ddp, ddp_bytes = results["DDP"]["curve"][-1][1], results["DDP"]["bytes"]
    lines = ["| run | final val loss | vs DDP | beats local SGD (same H) | bytes ÷ DDP |", "|---|---|---|---|---|"]
    for name, result in results.items():
        loss = result["curve"][-1][1]
        h = name.split("H=")[1].split()[0] if "H=" in name else None
        local = results.get(f"local SGD H={h}") if name.startswith("DiLoCo") else None
        beats = "" if local is None else ("yes" if loss < local["curve"][-1][1] else "no")
        sent = result["bytes"] / ddp_bytes
        lines.append(f"| {name} | {loss:.4f} | {100 * (loss / ddp - 1):+.1f} % | {beats} | {sent:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, 20 steps, a corner of the grid")
    parser.add_argument("--only", nargs="+", metavar="RUN", help="these runs of the grid (names as printed)")
    parser.add_argument("--out", default="sweep_diloco.json")
    parser.add_argument("--resume", action="store_true", help="keep the runs --out holds, run the others")
    parser.add_argument("--cache", default="/tmp/lightscale_bench_diloco_corpus")
    args = parser.parse_args()
    model = {"config": CONFIG} if args.quick or args.model == "tiny" else recipe_settings()
    settings = {**model, "val_batches": 2 if args.quick else 8}
    steps, val_every = (20, 10) if args.quick else (args.steps, args.val_every)
    tokenize_to_memmap(None, Path(args.cache), ByteTokenizer())  # once, before the ranks start
    out = Path(args.out)
    results: dict[str, dict[str, Any]] = json.loads(out.read_text()) if args.resume and out.exists() else {}
    runs = grid(args.quick, steps)
    unknown = sorted(set(args.only or ()) - set(runs))
    if unknown:
        parser.error(f"--only: no run named {unknown}; the grid has {sorted(runs)}")
    for name, strategy in runs.items():
        if (args.only and name not in args.only) or name in results:
            continue
        start = time.perf_counter()
        results[name] = run_distributed(
            _train, strategy, steps, val_every, args.cache, world_size=WORKERS, timeout_s=24 * 3600, **settings
        )[0]
        print(f"{name}: {results[name]['curve'][-1][1]:.4f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        out.write_text(json.dumps(results))  # a partial sweep survives (--resume goes on from it)
    print(table({name: results[name] for name in runs if name in results}))  # in the grid's order


if __name__ == "__main__":
    main()
