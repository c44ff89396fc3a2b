"""``make gpu-check``'s context-parallel row: one CP block forward and backward by each fused CUDA op that ring and
allgather attention can run (lightscale/parallel/context_parallel/kernels.py) ÷ ``F.scaled_dot_product_attention``
forward and backward (autograd, torch's own choice of kernel) over the same block. Imports inside the function, so
importing this module costs nothing (benchmarks/gpu_check.py runs it in a child process)."""

from __future__ import annotations

from typing import Any

SHAPE = (1, 16, 4096, 128)  # one (query chunk, key chunk) block: 4096 tokens each, 16 heads of 128
KERNELS = (("flash", "bfloat16"), ("efficient", "bfloat16"), ("efficient", "float32"), ("cudnn", "bfloat16"))


def _median_ms(torch: Any, fn: Any, repeats: int = 10, warmup: int = 3) -> float:
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cp_block_kernels() -> dict[str, Any]:
    rows = [_row(name, dtype) for name, dtype in KERNELS]
    return {"rows": rows, "notes": [f"block {SHAPE}, non-causal; SDPA: autograd over the same block"]}


def _row(name: str, dtype_name: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from lightscale.parallel.context_parallel.kernels import block_backward, block_forward, choose_kernel

    dtype = getattr(torch, dtype_name)
    q, k, v, grad = (torch.randn(SHAPE, device="cuda", dtype=dtype) for _ in range(4))
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    if not getattr(torch.backends.cuda, f"can_use_{name}_attention")(params):
        return {"op": name, "dtype": dtype_name, "note": "not usable here (can_use_* is False)"}
    scale = SHAPE[-1] ** -0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def ours() -> torch.Tensor:
        out, lse = block_forward(name, q, k, v, causal=False, scale=scale)
        return block_backward(name, grad, q, k, v, out, lse, causal=False, scale=scale)[0]

    def sdpa() -> None:
        F.scaled_dot_product_attention(*leaves, scale=scale).backward(grad)

    dq = ours()
    reference = F.scaled_dot_product_attention(*(t.float() for t in leaves), scale=scale)
    reference.backward(grad.float())
    error = float((dq.float() - leaves[0].grad).abs().max() / leaves[0].grad.abs().max())
    ms, sdpa_ms = _median_ms(torch, ours), _median_ms(torch, sdpa)
    return {
        "op": name,
        "dtype": dtype_name,
        "chosen for this dtype": choose_kernel(q, k, v),
        "block fwd+bwd ms": round(ms, 3),
        "SDPA fwd+bwd ms": round(sdpa_ms, 3),
        "ratio": round(ms / sdpa_ms, 3),
        "dq rel. error vs fp32": f"{error:.1e}",
    }
