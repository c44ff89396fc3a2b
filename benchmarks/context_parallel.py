"""Context-parallel attention: ring vs allgather vs ulysses step time, and zigzag vs contiguous load balance.

One causal attention layer of a long sequence, sharded over 2 forked gloo ranks, fp32: forward and backward of
``F.scaled_dot_product_attention`` under :class:`ContextParallelAttention`, the modes interleaved ABBA, the first
step of each dropped, median step time (the slower rank's). Load balance: the ring under the zigzag and the
contiguous layout, each rank's CPU time inside block attention (forward), max / min over the ranks.

    python benchmarks/context_parallel.py [--seq 4096] [--heads 4] [--head-dim 64] [--repeats 4]
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
from common import interleaved, median

from lightscale.parallel.context_parallel import ContextParallelAttention, blocks, shard_sequence
from lightscale.testing import run_distributed

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


def _slowest(ranks: list[dict[str, list[tuple[float, ...]]]], name: str, field: int) -> float:
    """Median over repeats of the slowest rank's value."""
    return median([max(r[name][i][field] for r in ranks) for i in range(len(ranks[0][name]))])


if __name__ == "__main__":
    main()
