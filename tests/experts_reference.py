"""The routed experts one matmul pair at a time: the reference the grouped GEMM of lightscale/layers/grouped_mm.py
is checked against (tests/unit/test_grouped_mm.py, tests/gpu/test_grouped_mm_cuda.py) and timed against
(benchmarks/bench_experts.py, benchmarks/gpu_moe_float8.py)."""

from __future__ import annotations

import torch


def loop_experts(tokens: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``gelu(x_e @ w1[e]) @ w2[e]`` for each expert's rows of ``tokens`` (``counts[e]`` of them, in order)."""
    chunks = tokens.split(counts.tolist())
    outputs = [torch.nn.functional.gelu(chunk @ w1[e]) @ w2[e] for e, chunk in enumerate(chunks)]
    return torch.cat(outputs) if outputs else tokens.new_zeros(0, w2.shape[-1])
