"""parallel_3d: (1) measured pipeline idle per rank vs each schedule's bubble; (2) tp=2 step time vs a DTensor loop;
(3) the cost of checking that tp ranks got the same batch.

(1) Every stage is the same stack of Linear layers (equal cost by construction). On 2 forked ranks each schedule
runs ``--microbatches`` microbatches; the busy time of a rank is calibrated by running its stages' forward and
backward for the same microbatches alone in one process; idle = 1 - busy / step time. The theoretical bubble is
(p - 1) / (m + p - 1) for gpipe and 1f1b and the simulated idle of the schedule's own action lists (forward 1,
backward 2) for the others; the ratio measured / theoretical is 1 for a perfect runtime.

(2) The GPT recipe under ``parallel_3d`` with tp=2 (Lightning's loop) vs a hand-written loop doing the same work:
``parallelize_gpt`` on the same mesh, forward + backward under ``loss_parallel``, AdamW step. Interleaved ABBA,
medians of step times after warm-up.

(3) The same tp=2 run with the batch agreement check (lightscale/data/batch_agreement.py) at every other step:
the median time of the checked steps over that of the unchecked ones, side by side in one run; and the check's own
cost (the median of 50 checks of a batch the run's size on the same 2 ranks) as a share of a step, every step and at
the default interval.

    python benchmarks/bench_3d.py [--microbatches 4] [--steps 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import median

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, os.path.dirname(__file__))
from common import StepTimer, interleaved, timed_trainer

from lightscale.commands.schedule_plot import idle_fractions, schedule_slots, theoretical_bubble
from lightscale.data.batch_agreement import DEFAULT_EVERY, BatchAgreement
from lightscale.parallel.pipeline import default_stages_per_rank, schedule_class, stage_ids
from lightscale.recipes.gpt import GPT, GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.parallelize import parallelize_gpt
from lightscale.strategies import Parallel3DStrategy, ParallelDims
from lightscale.testing import run_distributed

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"]
WIDTH, LAYERS_PER_STAGE, MICRO_BATCH = 1024, 4, 128  # ~1 GFLOP per stage forward: compute, not overhead
MODEL = GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=256)
WARMUP = 2
CHECK_STEPS = 40  # (3): half of them checked; fewer leave the ratio to the machine's noise


def _stage(index: int) -> nn.Module:
    torch.manual_seed(index)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS_PER_STAGE)))


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _busy(stages: list[nn.Module], microbatches: int) -> float:
    """Seconds of forward + backward of ``stages`` over ``microbatches`` microbatches, alone (no pipeline)."""
    x = torch.randn(MICRO_BATCH, WIDTH)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(microbatches):
            for stage in stages:
                stage(x.requires_grad_()).square().mean().backward()
        times.append(time.perf_counter() - start)
    return median(times[1:])


def _pipeline_idle(name: str, microbatches: int, steps: int) -> float:
    pp, rank = dist.get_world_size(), dist.get_rank()
    per_rank = default_stages_per_rank(name)
    ids = stage_ids(rank, pp, per_rank, v_shape=name == "zbv")
    modules = [_stage(i) for i in ids]
    busy = _busy(modules, microbatches)
    stages = [PipelineStage(m, i, pp * per_rank, torch.device("cpu")) for i, m in zip(ids, modules, strict=True)]
    schedule = schedule_class(name)(stages[0] if per_rank == 1 else stages, microbatches, loss_fn=_mse)
    x, y = torch.randn(MICRO_BATCH * microbatches, WIDTH), torch.randn(MICRO_BATCH * microbatches, WIDTH)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        kwargs = {"target": y, "losses": []} if any(s.is_last for s in stages) else {}
        schedule.step(*((x,) if any(s.is_first for s in stages) else ()), **kwargs)
        times.append(time.perf_counter() - start)
    return 1.0 - busy / median(times[WARMUP:])


def _theory(name: str, pp: int, microbatches: int) -> float:
    if name in ("gpipe", "1f1b"):
        return theoretical_bubble(pp, microbatches)
    return sum(idle_fractions(schedule_slots(name, pp=pp, microbatches=microbatches), pp)) / pp


def _lightscale_tp(steps: int, cache_dir: str) -> float:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(WARMUP)
    trainer = timed_trainer(Parallel3DStrategy(tp=2), devices=2, steps=steps, callbacks=[timer])
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=8, cache_dir=cache_dir)
    trainer.fit(GPTModule(MODEL, warmup_steps=1), data)
    return median(timer.times)


def _raw_tp(steps: int, cache_dir: str) -> float:
    torch.manual_seed(0)
    mesh = ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    model = parallelize_gpt(GPT(MODEL), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=8, cache_dir=cache_dir)
    data.setup("fit")
    batches = iter(torch.utils.data.DataLoader(data.train_dataloader().dataset, batch_size=8))
    times = []
    for _ in range(steps):
        tokens, targets = next(batches)
        start = time.perf_counter()
        with loss_parallel():
            GPTModule.loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return median(times[WARMUP:])


def _check_cost(calls: int = 50) -> float:
    """Seconds of one batch agreement check (checksum, all-gather, compare) of a batch of 8 x block_size tokens."""
    agreement = BatchAgreement(ParallelDims(world_size=2, tp=2), every=1)
    tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.block_size + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        agreement.maybe_check(batch, device=torch.device("cpu"))
        times.append(time.perf_counter() - start)
    return median(times[WARMUP:])


def _checked_vs_unchecked(steps: int, cache_dir: str) -> tuple[float, float]:
    """Median step time of the checked and the unchecked steps of one tp=2 run checking every other step: side by
    side in the same processes, so load drift hits both alike."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer(WARMUP)
    strategy = Parallel3DStrategy(tp=2, check_batches_every=2)
    trainer = timed_trainer(strategy, devices=2, steps=steps, callbacks=[timer])
    trainer.fit(
        GPTModule(MODEL, warmup_steps=1), GPTDataModule(block_size=MODEL.block_size, batch_size=8, cache_dir=cache_dir)
    )
    checked = [t for i, t in enumerate(timer.times, start=WARMUP) if i % 2 == 0]
    unchecked = [t for i, t in enumerate(timer.times, start=WARMUP) if i % 2 == 1]
    return median(checked), median(unchecked)


def _check_overhead(steps: int, repeats: int, cache: str) -> None:
    runs = [run_distributed(_checked_vs_unchecked, steps, cache, world_size=2, timeout_s=600) for _ in range(repeats)]
    on = median([max(rank[0] for rank in run) for run in runs])
    off = median([max(rank[1] for rank in run) for run in runs])
    cost = max(run_distributed(_check_cost, world_size=2))
    share = cost / off
    print(
        f"bench_3d (3): batch agreement check, tp=2, every other step of one run: checked steps {on * 1e3:.1f} ms, "
        f"unchecked {off * 1e3:.1f} ms, ratio {on / off:.3f}; one check alone {cost * 1e3:.2f} ms = {share:.2%} of "
        f"a step; at the default (every {DEFAULT_EVERY} steps) {share / DEFAULT_EVERY:.4%} per step"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    pp, m = 2, args.microbatches
    print(f"bench_3d (1): pipeline idle, {pp} ranks, {m} microbatches, stages {LAYERS_PER_STAGE} x Linear({WIDTH})")
    print(f"{'schedule':18} {'idle rank0':>10} {'idle rank1':>10} {'theory':>8} {'ratio':>6}")
    for name in SCHEDULES:
        idle = run_distributed(_pipeline_idle, name, m, args.steps + WARMUP, world_size=pp, timeout_s=600)
        theory = _theory(name, pp, m)
        ratio = (sum(idle) / pp) / theory
        print(f"{name:18} {idle[0]:10.1%} {idle[1]:10.1%} {theory:8.1%} {ratio:6.2f}")
    from lightscale.recipes.gpt.data import ByteTokenizer, default_cache_dir, tokenize_to_memmap

    cache = str(default_cache_dir())
    tokenize_to_memmap(None, default_cache_dir(), ByteTokenizer())
    times: dict[str, list[float]] = {"parallel_3d": [], "dtensor_loop": []}
    for name in interleaved(list(times), args.repeats):
        fn = _lightscale_tp if name == "parallel_3d" else _raw_tp
        times[name].append(run_distributed(fn, args.steps + WARMUP, cache, world_size=2, timeout_s=600)[0])
    ours, raw = median(times["parallel_3d"]), median(times["dtensor_loop"])
    print(
        f"bench_3d (2): GPT {MODEL.n_layer}x{MODEL.n_embd}, tp=2, batch 8x{MODEL.block_size}: parallel_3d "
        f"{ours * 1e3:.1f} ms/step, DTensor loop {raw * 1e3:.1f} ms/step, ratio {ours / raw:.3f}"
    )
    _check_overhead(CHECK_STEPS, args.repeats, cache)


if __name__ == "__main__":
    main()
