"""ZeRO++ on FSDP2: does int8 on the wire change learning, and what does it buy on a slow link?

1. Learning: the tiny GPT (AdamW, the recipe's schedule) trained ``--steps`` steps on 2 CPU ranks, the same tokens, as
   ``fsdp2`` and as fsdp2 with int8 weights + int8 gradients (and int8 + int4); printed: the mean loss of the last 50
   steps of each and its ratio to fsdp2's, and the largest gap of the 50-step running means along the way.
2. Slow link: the same ranks as two "nodes" joined by a throttled link (lightscale.comm_counter.SlowLink, every
   collective waits for its ring traffic at ``--mbytes-per-second``; no overlap), step time of fsdp2 ÷ fsdp2 + ZeRO++
   int8/int8, interleaved A B B A; and the same ratio unthrottled (what quantizing costs when links are fast). On a
   shared machine wall time is noisy, so each is also given as the rank's CPU time per step plus the link's wait
   (the CPU time counts every thread of the process, gloo's included).

    python benchmarks/bench_zeropp.py [--steps 500] [--seeds 0 1 2] [--variants ...] [--link-steps 40]
                                      [--mbytes-per-second 10] [--only learning|link]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from common import LossStepTimer, interleaved, median, timed_trainer

from lightscale.comm_counter import SlowLink
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.data import ByteTokenizer, tokenize_to_memmap
from lightscale.strategies import FSDP2Strategy
from lightscale.testing import run_distributed

CONFIG = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
RANKS, BATCH, WARMUP, WINDOW = 2, 8, 5, 50
VARIANTS = {
    "fsdp2": {},
    "zeropp int8/int8": {"quantized_weights": "int8", "quantized_gradients": "int8"},
    "zeropp int8/int4": {"quantized_weights": "int8", "quantized_gradients": "int4"},
    "weights int8 only": {"quantized_weights": "int8"},  # which wire moves the curve
    "gradients int8 only": {"quantized_gradients": "int8"},
    "fsdp2 bf16 gradients": {"compression": "bf16"},  # an accepted wire change, to calibrate the gaps
}


class CpuTime(pl.Callback):
    """Process CPU time of each step after the warm-up (all threads: gloo's communication too)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > WARMUP:
            self.times.append(time.process_time() - self._start)


def _train(name: str, steps: int, bytes_per_second: float | None, cache: str, seed: int = 0) -> dict[str, Any]:
    pl.seed_everything(seed, verbose=False)
    timer, cpu = LossStepTimer(WARMUP), CpuTime()
    trainer = timed_trainer(FSDP2Strategy(**VARIANTS[name]), devices=RANKS, steps=steps, callbacks=[timer, cpu])
    data = GPTDataModule(block_size=CONFIG.block_size, batch_size=BATCH, cache_dir=cache)
    link = SlowLink(bytes_per_second=bytes_per_second, ranks=RANKS) if bytes_per_second else None
    with link or contextlib.nullcontext():
        trainer.fit(GPTModule(CONFIG, learning_rate=3e-3), data)
    return {
        "losses": timer.losses,
        "step_s": sum(timer.times) / len(timer.times),
        "cpu_s": sum(cpu.times) / len(cpu.times),
        "wait_s": link.seconds_waited / steps if link else 0.0,
        "bytes": sum(c.bytes for c in link.calls) / steps if link else 0,
    }


def _global_losses(name: str, steps: int, cache: str, seed: int) -> list[float]:
    per_rank = run_distributed(_train, name, steps, None, cache, seed, world_size=RANKS, timeout_s=3600)
    return [sum(step) / RANKS for step in zip(*(r["losses"] for r in per_rank), strict=True)]


def _running_mean(values: list[float]) -> list[float]:
    return [sum(values[i - WINDOW : i]) / WINDOW for i in range(WINDOW, len(values) + 1)]


def learning(steps: int, cache: str, only: list[str], seeds: list[int]) -> None:
    print(f"tiny GPT {CONFIG}, {RANKS} ranks x batch {BATCH}, {steps} steps, same tokens per seed")
    print(f"{'seed':>4} {'variant':<22} {'last-50 mean loss':>18} {'ratio to fsdp2':>15} {'largest gap':>12}")
    for seed in seeds:
        curves = {name: _global_losses(name, steps, cache, seed) for name in ["fsdp2", *only]}
        reference = _running_mean(curves["fsdp2"])
        for name, losses in curves.items():
            mean = _running_mean(losses)
            gap = max(abs(a - b) / b for a, b in zip(mean, reference, strict=True))
            print(f"{seed:>4} {name:<22} {mean[-1]:>18.4f} {mean[-1] / reference[-1]:>15.4f} {gap:>11.2%}")


def link(steps: int, mbytes_per_second: float, repeats: int, cache: str) -> None:
    names = ["fsdp2", "zeropp int8/int8"]
    found: dict[float | None, dict[str, dict[str, float]]] = {}
    for rate in (mbytes_per_second * 1e6, None):
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for name in interleaved(names, repeats):
            runs[name].append(run_distributed(_train, name, steps, rate, cache, world_size=RANKS, timeout_s=3600)[0])
        found[rate] = {
            name: {key: median([r[key] for r in results]) for key in ("step_s", "cpu_s", "wait_s", "bytes")}
            for name, results in runs.items()
        }
        a, b = found[rate]["fsdp2"], found[rate][names[1]]
        cpu_a, cpu_b = a["cpu_s"] + a["wait_s"], b["cpu_s"] + b["wait_s"]
        label = f"link {mbytes_per_second:g} MB/s" if rate else "unthrottled"
        print(f"{label}: wall step fsdp2 {a['step_s'] * 1e3:.1f} ms, ZeRO++ {b['step_s'] * 1e3:.1f} ms, ratio "
              f"{a['step_s'] / b['step_s']:.2f}; CPU + link wait {cpu_a * 1e3:.1f} ms vs {cpu_b * 1e3:.1f} ms, "
              f"ratio {cpu_a / cpu_b:.2f} "
              f"(wait {a['wait_s'] * 1e3:.1f} vs {b['wait_s'] * 1e3:.1f} ms, "
              f"bytes/step {a['bytes']:,.0f} vs {b['bytes']:,.0f})")  # fmt: skip
    # SlowLink's dispatch mode costs CPU per op (ZeRO++ runs more, smaller ops): compute measured without it + the wait.
    slow, fast = found[mbytes_per_second * 1e6], found[None]
    composed = {name: fast[name]["cpu_s"] + slow[name]["wait_s"] for name in names}
    print(f"unthrottled CPU + the link's wait: {composed['fsdp2'] * 1e3:.1f} ms vs {composed[names[1]] * 1e3:.1f} ms, "
          f"fsdp2 / ZeRO++ = {composed['fsdp2'] / composed[names[1]]:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--link-steps", type=int, default=40)
    parser.add_argument("--mbytes-per-second", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", choices=["learning", "link"])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS)[1:], choices=list(VARIANTS)[1:])
    parser.add_argument("--cache", default="/tmp/lightscale_bench_zeropp_corpus")
    args = parser.parse_args()
    tokenize_to_memmap(None, Path(args.cache), ByteTokenizer())  # once, before the ranks start
    if args.only != "link":
        learning(args.steps, args.cache, args.variants, args.seeds)
    if args.only != "learning":
        link(args.link_steps, args.mbytes_per_second, args.repeats, args.cache)


if __name__ == "__main__":
    main()
