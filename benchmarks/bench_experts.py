"""The routed experts' FFN alone: grouped GEMM (what MoE layers run) ÷ the per-expert loop (the test reference).

One process, 64 experts, forward + backward of ``gelu(x_e @ w1[e]) @ w2[e]`` over the tokens each expert received
(top 2 of a batch of 8 x 128 tokens, routed by a random router, so groups are uneven and some small), in fp32 and
in bf16; interleaved ABBA, median of the timed calls.

    python benchmarks/bench_experts.py [--experts 64] [--width 128] [--repeats 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))  # the loop: a test reference
from common import interleaved, median
from experts_reference import loop_experts

from lightscale.layers.grouped_mm import grouped_mlp

CALLS = 5  # timed forward + backward calls per repeat


def _inputs(experts: int, width: int, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    choice = torch.randn(tokens, experts).topk(2, dim=-1).indices.flatten()
    counts = torch.bincount(choice, minlength=experts)
    x = torch.randn(int(counts.sum()), width, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(experts, width, 4 * width) / width**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(experts, 4 * width, width) / (4 * width) ** 0.5).to(dtype).requires_grad_()
    return x, counts, w1, w2


def _time(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> float:
    grad = torch.randn(inputs[0].shape, dtype=inputs[0].dtype)
    start = time.perf_counter()
    for _ in range(CALLS):
        fn(*inputs).backward(grad)
    return (time.perf_counter() - start) / CALLS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8 * 128)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        inputs = _inputs(args.experts, args.width, args.tokens, dtype)
        kernels = {"grouped": grouped_mlp, "loop": loop_experts}
        _time(grouped_mlp, inputs), _time(loop_experts, inputs)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for name in interleaved(list(kernels), args.repeats):
            times[name].append(_time(kernels[name], inputs))
        grouped, loop = median(times["grouped"]), median(times["loop"])
        print(
            f"bench_experts: {args.experts} experts, width {args.width} x {4 * args.width}, {inputs[0].shape[0]} "
            f"token copies, {str(dtype).removeprefix('torch.')}, fwd+bwd on CPU: grouped GEMM {grouped * 1e3:.1f} ms, "
            f"loop {loop * 1e3:.1f} ms, ratio grouped/loop {grouped / loop:.3f}"
        )


if __name__ == "__main__":
    main()
