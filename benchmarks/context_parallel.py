"""Context-parallel attention: ring vs allgather vs ulysses step time, and zigzag vs contiguous load balance.

One causal attention layer of a long sequence, sharded over 2 forked gloo ranks, fp32: forward and backward of
``F.scaled_dot_product_attention`` under :class:`ContextParallelAttention`, the modes interleaved ABBA, the first
step of each dropped, median step time (the slower rank's). Load balance: the ring under the zigzag and the
contiguous layout, each rank's time inside block attention (forward), max / min over the ranks.

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
    start = time.perf_counter()
    out = _block_attention(*args, **kwargs)
    SPENT[0] += time.perf_counter() - start
    return out


def _step(q: torch.Tensor, mode: str, layout: str) -> tuple[float, float]:
    """(step seconds, block-attention seconds) of one forward and backward on this rank."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    local = [shard_sequence(q, cp, rank, dim=2, layout=layout).requires_grad_() for _ in range(3)]
    dist.barrier()
    SPENT[0] = 0.0
    start = time.perf_counter()
    with ContextParallelAttention(mode=mode, layout=layout):  # type: ignore[arg-type]
        F.scaled_dot_product_attention(*local, is_causal=True).sum().backward()
    return time.perf_counter() - start, SPENT[0]


def _run(shape: tuple[int, ...], repeats: int) -> dict[str, list[tuple[float, float]]]:
    blocks.block_attention = _timed_block  # the name attend() looks up at call time
    torch.manual_seed(0)
    q = torch.randn(shape)
    names = [f"{mode}/{layout}" for mode, layout in CANDIDATES]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
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
    step = {name: median([max(r[name][i][0] for r in ranks) for i in range(args.repeats)]) for name in ranks[0]}
    base = step["ring/zigzag"]
    for name, seconds in step.items():
        print(f"  {name:<22} step {seconds * 1e3:8.1f} ms   x{seconds / base:.2f} of ring/zigzag")
    for layout in ("zigzag", "contiguous"):
        compute = [median([t[1] for t in r[f"ring/{layout}"]]) for r in ranks]
        shown = ", ".join(f"{c * 1e3:.1f}" for c in compute)
        print(f"  ring/{layout:<11} attention compute per rank [{shown}] ms, max/min {max(compute) / min(compute):.2f}")


if __name__ == "__main__":
    main()
