"""Context parallelism: (1) ring vs allgather vs ulysses step time, zigzag vs contiguous load balance; (2) cp2 in
Lightning's loop vs a hand-written loop over the same attention function.

(1) One causal attention layer of a long sequence, sharded over 2 forked gloo ranks, fp32: forward and backward of
``F.scaled_dot_product_attention`` under :class:`ContextParallelAttention`, the modes interleaved ABBA, the first
step of each dropped, median step time (the slower rank's). Load balance: the ring under the zigzag and the
contiguous layout, each rank's CPU time inside block attention (forward), max / min over the ranks.

(2) The GPT recipe under ``Parallel3DStrategy(cp=2)`` (Lightning's loop: the batch cut along the sequence, SDPA
routed, FSDP2 over the 2 ranks, AdamW) vs a hand-written loop doing the same work: the same mesh and
``parallelize_model`` (FSDP2), ``shard_sequence`` on tokens and targets, forward under ``ContextParallelAttention``,
backward, AdamW step. Interleaved ABBA, medians of step times after warm-up; the losses show both did the same work.

    python benchmarks/context_parallel.py [--seq 4096] [--heads 4] [--head-dim 64] [--repeats 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import lightning.pytorch as pl
from common import LossStepTimer, interleaved, median, timed_trainer

from lightscale.parallel.context_parallel import ContextParallelAttention, blocks, shard_sequence
from lightscale.parallel.contract import sharding_units
from lightscale.parallel.parallelize import ParallelizeOptions, parallelize_model
from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.data import ByteTokenizer, default_cache_dir, tokenize_to_memmap
from lightscale.strategies import Parallel3DStrategy, ParallelDims
from lightscale.testing import run_distributed

MODEL = GPTConfig(block_size=1024, n_layer=2, n_head=4, n_embd=128)
BATCH, WARMUP = 2, 2

CANDIDATES = [("ring", "zigzag"), ("allgather", "zigzag"), ("ulysses", "zigzag"), ("ring", "contiguous")]
SPENT = [0.0]  # seconds inside block attention on this rank
_block_attention = blocks.block_attention


def _timed_block(*args: Any, **kwargs: Any) -> blocks.Partial:
    # CPU time of this thread (one OpenMP thread): not inflated when other processes hold the cores.
    start = time.thread_time()
    out = _block_attention(*args, **kwargs)
    SPENT[0] += time.thread_time() - start
    return out


def _step(q: torch.Tensor, mode: str, layout: str) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, block-attention CPU seconds) of one forward and backward on this rank."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    local = [shard_sequence(q, cp, rank, dim=2, layout=layout).requires_grad_() for _ in range(3)]
    dist.barrier()
    SPENT[0] = 0.0
    start, cpu = time.perf_counter(), time.thread_time()
    with ContextParallelAttention(mode=mode, layout=layout):  # type: ignore[arg-type]
        F.scaled_dot_product_attention(*local, is_causal=True).sum().backward()
    return time.perf_counter() - start, time.thread_time() - cpu, SPENT[0]


def _run(shape: tuple[int, ...], repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    blocks.block_attention = _timed_block  # the name attend() looks up at call time
    torch.manual_seed(0)
    q = torch.randn(shape)
    names = [f"{mode}/{layout}" for mode, layout in CANDIDATES]
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for i, name in enumerate(interleaved(names, repeats + 1)):
        result = _step(q, *name.split("/"))
        if i >= len(names):  # the first round warms up
            times[name].append(result)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    shape = (1, args.heads, args.seq, args.head_dim)
    ranks = run_distributed(_run, shape, args.repeats, world_size=2, timeout_s=1800, collective_timeout_s=600)
    print(f"causal attention, {args.seq} tokens, {args.heads} heads x {args.head_dim}, cp=2, fp32, fwd+bwd")
    # Wall time waits for the slower rank and for cores other processes hold; CPU time is this rank's own work.
    wall, cpu = ({name: _slowest(ranks, name, i) for name in ranks[0]} for i in (0, 1))
    for name in ranks[0]:
        print(
            f"  {name:<17} step wall {wall[name] * 1e3:7.1f} ms (x{wall[name] / wall['ring/zigzag']:.2f}), "
            f"CPU {cpu[name] * 1e3:7.1f} ms (x{cpu[name] / cpu['ring/zigzag']:.2f}) of ring/zigzag"
        )
    for layout in ("zigzag", "contiguous"):
        compute = [median([t[2] for t in r[f"ring/{layout}"]]) for r in ranks]
        shown = ", ".join(f"{c * 1e3:.1f}" for c in compute)
        print(f"  ring/{layout:<11} attention compute per rank [{shown}] ms, max/min {max(compute) / min(compute):.2f}")
    _loop_ratio(args.steps, max(2, args.repeats // 2))


def _lightscale_cp(steps: int, cache_dir: str) -> tuple[float, list[float]]:
    pl.seed_everything(0, verbose=False)
    timer = LossStepTimer(WARMUP)
    trainer = timed_trainer(Parallel3DStrategy(cp=2), devices=2, steps=steps, callbacks=[timer])
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=BATCH, cache_dir=cache_dir, shuffle=False)
    trainer.fit(GPTModule(MODEL, warmup_steps=1), data)
    return median(timer.times), timer.losses


def _raw_cp(steps: int, cache_dir: str) -> tuple[float, list[float]]:
    """The same work by hand: FSDP2 over the cp ranks, the sequence cut zigzag, SDPA routed over the ring."""
    pl.seed_everything(0, verbose=False)
    cp, rank = dist.get_world_size(), dist.get_rank()
    module = GPTModule(MODEL, warmup_steps=1)
    module.configure_model()
    mesh = ParallelDims(world_size=cp, cp=cp).build_mesh("cpu")
    parallelize_model(module.model, mesh, units=sharding_units(module), options=ParallelizeOptions())
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    data = GPTDataModule(block_size=MODEL.block_size, batch_size=BATCH, cache_dir=cache_dir, shuffle=False)
    data.setup("fit")
    batches = iter(torch.utils.data.DataLoader(data.train_dataloader().dataset, batch_size=BATCH))
    attention = ContextParallelAttention(dist.group.WORLD, mode="ring")
    times, losses = [], []
    for _ in range(steps):
        tokens, targets = (shard_sequence(t, cp, rank) for t in next(batches))
        start = time.perf_counter()
        with attention:
            loss = GPTModule.loss_fn(module.model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return median(times[WARMUP:]), losses


def _loop_ratio(steps: int, repeats: int) -> None:
    cache = str(default_cache_dir())
    tokenize_to_memmap(None, default_cache_dir(), ByteTokenizer())
    times: dict[str, list[float]] = {"cp2": [], "hand_loop": []}
    losses: dict[str, list[float]] = {}
    for name in interleaved(list(times), repeats):
        fn = _lightscale_cp if name == "cp2" else _raw_cp
        step, losses[name] = run_distributed(fn, steps + WARMUP, cache, world_size=2, timeout_s=1800)[0]
        times[name].append(step)
    ours, raw = median(times["cp2"]), median(times["hand_loop"])
    print(
        f"GPT {MODEL.n_layer}x{MODEL.n_embd}, batch {BATCH}x{MODEL.block_size}, cp=2 ring, fp32, AdamW: cp2 in "
        f"Lightning's loop {ours * 1e3:.1f} ms/step, hand-written loop {raw * 1e3:.1f} ms/step, ratio {ours / raw:.3f}"
    )
    first = [round(losses[name][0], 4) for name in times]
    print(f"  first-step loss (rank 0's tokens) cp2 {first[0]}, hand loop {first[1]}: the same work")


def _slowest(ranks: list[dict[str, list[tuple[float, ...]]]], name: str, field: int) -> float:
    """Median over repeats of the slowest rank's value."""
    return median([max(r[name][i][field] for r in ranks) for i in range(len(ranks[0][name]))])


if __name__ == "__main__":
    main()
