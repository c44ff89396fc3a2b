"""``make gpu-check``'s rows for the MoE and float8 kernels: the routed experts' FFN by grouped GEMM ÷ the per-expert
loop at 64 experts (bf16, forward + backward), and GPT-2 124M tokens/s in float8 ÷ bf16-mixed under fsdp2 with
per-block compile. Imports inside the functions, so importing this module costs nothing (benchmarks/gpu_check.py
runs each in a child process; the grouped row also runs on a CPU, which the CPU tests use)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

# The per-expert loop is a test reference (tests/experts_reference.py), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

EXPERTS = {"experts": 64, "width": 1024, "tokens": 8 * 1024}  # top 2: 16,384 token copies, hidden 4 x width


def grouped_vs_loop(experts: int, width: int, tokens: int, repeats: int = 10) -> dict[str, Any]:
    """Median forward + backward time of grouped GEMM and of the loop on the same uneven groups, and their ratio."""
    import torch
    from experts_reference import loop_experts

    from lightscale.layers.grouped_mm import grouped_mlp

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    counts = torch.bincount(torch.randn(tokens, experts).topk(2, dim=-1).indices.flatten(), minlength=experts)
    dtype = torch.bfloat16
    x = torch.randn(int(counts.sum()), width, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(experts, width, 4 * width, device=device) / width**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(experts, 4 * width, width, device=device) / (2 * width)).to(dtype).requires_grad_()
    grad = torch.randn_like(x)
    times = {
        name: _median_s(torch, lambda fn=fn: fn(x, counts.to(device), w1, w2).backward(grad), repeats)
        for name, fn in (("grouped", grouped_mlp), ("loop", loop_experts))
    }
    return {
        "experts": experts,
        "width": f"{width} x {4 * width}",
        "token copies": int(counts.sum()),
        "dtype": "bf16",
        "grouped ms": round(times["grouped"] * 1e3, 2),
        "loop ms": round(times["loop"] * 1e3, 2),
        "grouped / loop": round(times["grouped"] / times["loop"], 3),
    }


def _median_s(torch: Any, fn: Any, repeats: int, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def float8_vs_bf16(steps: int = 25, warmup: int = 10, micro_batch: int = 16) -> dict[str, Any]:
    """GPT-2 124M under fsdp2 + per-block compile, the same random batches: tokens/s in each precision, the ratio."""
    rows = [_tokens_per_s(precision, steps, warmup, micro_batch) for precision in ("bf16-mixed", "float8")]
    ratio = rows[1]["tokens/s"] / rows[0]["tokens/s"]
    rows.append({"precision": "float8 / bf16-mixed", "tokens/s": round(ratio, 3)})
    note = (
        f"GPT-2 124M, 1024 tokens, micro-batch {micro_batch}, fsdp2 + per-block compile, {steps - warmup} timed steps"
    )
    return {"rows": rows, "notes": [note]}


def _tokens_per_s(precision: str, steps: int, warmup: int, micro_batch: int) -> dict[str, Any]:
    import torch
    from gpu_workers import GPT2, _gpt, _random_tokens, _Record, _trainer

    from lightscale.strategies.fsdp2.strategy import FSDP2Strategy

    torch.cuda.reset_peak_memory_stats()
    module = _gpt(GPT2, learning_rate=6e-4)
    record = _Record(warmup=warmup)
    trainer = _trainer(FSDP2Strategy(compile=True), steps=steps, precision=precision, callbacks=[record])
    trainer.fit(module, _random_tokens(GPT2, micro_batch, steps))
    seconds = record.end - record.start
    return {
        "precision": precision,
        "tokens/s": round(micro_batch * GPT2["block_size"] * record.timed / seconds),
        "step ms": round(1000 * seconds / max(record.timed, 1), 1),
        "loss first -> last": f"{record.losses[0]:.3f} -> {record.losses[-1]:.3f}",
        "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
