"""DiLoCo's learning figure on the small GPT: tens of outer rounds, 4 workers x 1 rank, the same tokens under each.

The model, learning rate, warm-up and batch of ``gpt/small_ddp.yaml``; the corpus is CPython's own library source
(every ``.py`` file outside the test suites, ~11 MB, byte tokens), so a run of this length reads each training
window less than once and the validation loss measures learning, not memorising the recipe's 460 KB default corpus.
DDP (``bucketed_ddp``) against local SGD, DiLoCo and streaming DiLoCo with their defaults, DiLoCo with the
paper's outer step, and DiLoCo with its defaults after a synchronous start of ``--synchronous-share`` of the steps,
all at ``--sync-every``:
validation loss of the global model every ``--val-every`` steps, bytes each rank handed to collectives ÷ DDP's.
Writes the curves to ``--image`` (docs/images/diloco_small_gpt.png) and ``--out`` (JSON, after every run). About
two hours on 2 CPU cores (``make bench-diloco`` runs it after the sweep).

    python benchmarks/diloco_learning.py [--steps 750] [--sync-every 30] [--val-every 75] [--resume] [--only RUN ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from bench_diloco import WORKERS, _train, plot, recipe_settings, synchronous_steps_for

from lightscale.parallel.diloco.outer_settings import PAPER_OUTER_STEP
from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap
from lightscale.testing import run_distributed

IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "diloco_small_gpt.png"
NOT_CORPUS = {"test", "tests", "idlelib", "lib2to3", "site-packages"}


def library_sources() -> list[str]:
    """This Python's own library source files, sorted (the test suites and third-party packages left out)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [str(p) for p in sorted(lib.rglob("*.py")) if not NOT_CORPUS & set(p.relative_to(lib).parts)]


def runs(sync_every: int, synchronous: int) -> dict[str, dict[str, Any] | None]:
    """Run name -> DiLoCoStrategy settings (None: DDP); DiLoCo's outer step is its default for H, then the paper's."""
    h = sync_every
    return {
        "DDP": None,
        f"local SGD H={h}": {"sync_every": h, "mode": "local_sgd"},
        f"DiLoCo H={h} (defaults)": {"sync_every": h},
        f"streaming DiLoCo H={h} (3 fragments, overlap 1)": {"sync_every": h, "fragments": 3, "overlap_steps": 1},
        f"DiLoCo H={h}, the paper's outer step (lr 0.7, momentum 0.9)": {
            "sync_every": h,
            "outer_lr": PAPER_OUTER_STEP[0],
            "outer_momentum": PAPER_OUTER_STEP[1],
        },
        f"DiLoCo H={h} (defaults), the first {synchronous} steps synchronous": {
            "sync_every": h,
            "synchronous_steps": synchronous,
        },
        f"streaming DiLoCo H={h} (3 fragments, overlap 1), the first {synchronous} steps synchronous": {
            "sync_every": h,
            "fragments": 3,
            "overlap_steps": 1,
            "synchronous_steps": synchronous,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=750)
    parser.add_argument("--sync-every", type=int, default=30)
    parser.add_argument("--val-every", type=int, default=75)
    parser.add_argument("--out", default="diloco_learning.json")
    parser.add_argument("--cache", default="/tmp/lightscale_bench_diloco_corpus")
    parser.add_argument("--synchronous-share", type=float, default=0.2, help="of the steps, in whole rounds")
    parser.add_argument("--resume", action="store_true", help="keep the runs --out holds, run the others")
    parser.add_argument("--only", nargs="+", metavar="RUN", help="these runs (names as printed)")
    parser.add_argument("--image", type=Path, default=IMAGE)
    args = parser.parse_args()
    synchronous = synchronous_steps_for(args.synchronous_share, args.steps, args.sync_every)
    chosen = runs(args.sync_every, synchronous)
    unknown = sorted(set(args.only or ()) - set(chosen))
    if unknown:
        parser.error(f"--only: no run named {unknown}; the runs are {sorted(chosen)}")
    texts = library_sources()
    tokenize_to_memmap(texts, Path(args.cache), ByteTokenizer())  # once, before the ranks start
    settings = {**recipe_settings(), "val_batches": 8, "text_files": texts}
    out = Path(args.out)
    results: dict[str, dict[str, Any]] = json.loads(out.read_text()) if args.resume and out.exists() else {}
    for name, strategy in chosen.items():
        if name in results or (args.only and name not in args.only):  # finished before (--resume), or not asked
            continue
        start = time.perf_counter()
        results[name] = run_distributed(
            _train,
            strategy,
            args.steps,
            args.val_every,
            args.cache,
            world_size=WORKERS,
            timeout_s=6 * 3600,
            **settings,
        )[0]
        print(f"{name}: {results[name]['curve'][-1][1]:.4f} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
        out.write_text(json.dumps(results))  # a partial run survives (--resume goes on from it)
    ddp = results["DDP"]
    print(f"{'method':<48} {'final val loss':>14} {'vs DDP':>8} {'bytes / DDP':>12}")
    for name, result in results.items():
        loss = result["curve"][-1][1]
        gap = 100 * (loss / ddp["curve"][-1][1] - 1)
        print(f"{name:<48} {loss:>14.4f} {gap:>+7.1f}% {result['bytes'] / ddp['bytes']:>12.4f}")
    plot(results, args.image, f"small GPT (10.8M), 4 workers x 1 rank, {args.steps} steps")


if __name__ == "__main__":
    main()
