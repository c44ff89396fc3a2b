"""The fused blocks of ring and allgather attention equal plain fp32 attention (tests/attention_reference.py): the
forward's output and log-sum-exp, each block's backward under a merged softmax, and the calls each step plans."""

from __future__ import annotations

import pytest
import torch
from attention_reference import block_attention, block_backward

from lightscale.parallel.context_parallel.blocks import Call, Partial, merge, plan
from lightscale.parallel.context_parallel.kernels import block_backward as fused_backward
from lightscale.parallel.context_parallel.kernels import block_forward, choose_kernel
from lightscale.parallel.context_parallel.token_split import chunk_ranges

BOUND = 1e-5
SCALE = 0.3


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _inputs(lq: int, lk: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return torch.randn(2, 3, lq, 8), torch.randn(2, 3, lk, 8), torch.randn(2, 3, lk, 8)


def test_cpu_uses_the_flash_for_cpu_op() -> None:
    assert choose_kernel(*_inputs(8, 8)) == "flash_cpu"


def test_forward_equals_fp32_reference() -> None:
    for lq, lk, causal in [(24, 40, False), (24, 24, True)]:
        q, k, v = _inputs(lq, lk)
        out, lse = block_forward("flash_cpu", q, k, v, causal=causal, scale=SCALE)
        ref_out, ref_lse = block_attention(q, k, v, scale=SCALE, causal=causal)
        assert _relative(out, ref_out) < BOUND and _relative(lse, ref_lse) < BOUND


def test_backward_of_each_block_under_the_merged_softmax() -> None:
    # Queries over two key blocks (the diagonal one causal): each block's backward with the merged output and
    # log-sum-exp is its share of the whole attention's gradient.
    q, k, v = _inputs(16, 32)
    grad = torch.randn(2, 3, 16, 8)
    blocks = [(slice(0, 16), False), (slice(16, 32), True)]
    parts = [Partial(*block_attention(q, k[..., s, :], v[..., s, :], scale=SCALE, causal=c)) for s, c in blocks]
    merged = merge(*parts)
    for keys, causal in blocks:
        args = (grad, q, k[..., keys, :], v[..., keys, :], merged.out, merged.lse)
        ours = fused_backward("flash_cpu", *args, causal=causal, scale=SCALE)
        reference = block_backward(*args, causal=causal, scale=SCALE)
        assert max(_relative(a, b) for a, b in zip(ours, reference, strict=True)) < BOUND
    # Planted: the block's own log-sum-exp instead of the merged one is far off.
    first = (q, k[..., :16, :], v[..., :16, :])
    own = fused_backward("flash_cpu", grad, *first, parts[0].out, parts[0].lse, causal=False, scale=SCALE)
    reference = block_backward(grad, *first, merged.out, merged.lse, causal=False, scale=SCALE)
    assert _relative(own[0], reference[0]) > 100 * BOUND


def test_each_ring_step_is_one_call_and_allgather_a_few() -> None:
    # cp = 2, zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (4 chunks of 4 tokens).
    r0, r1 = chunk_ranges(16, 2, 0), chunk_ranges(16, 2, 1)
    assert plan(r0, r0, causal=True) == [Call(0, 2, 0, 2, True)]  # its own chunks: one causal call
    assert plan(r0, r1, causal=True) == [Call(1, 2, 0, 2, False)]  # only the tail chunk sees rank 1's keys
    assert plan(r1, r0, causal=True) == [Call(0, 2, 0, 1, False)]  # both see rank 0's head chunk only
    assert plan(r0, r1, causal=False) == [Call(0, 2, 0, 2, False)]
    ordered = sorted(r0 + r1)  # allgather: the whole sequence in order
    assert plan(r1, ordered, causal=True) == [
        Call(0, 1, 0, 1, False),
        Call(0, 1, 1, 2, True),
        Call(1, 2, 0, 2, False),
        Call(1, 2, 2, 3, True),
    ]


@pytest.mark.parametrize("name", ["flash", "efficient", "cudnn"])
def test_cuda_ops_take_these_arguments(name: str) -> None:
    # The CUDA ops cannot run here; their meta kernels check the argument lists and give the shapes (the efficient
    # op pads its log-sum-exp to 64 rows for 40 queries, cuDNN's has a trailing 1: both come back (B, H, Lq)).
    q, k = (torch.empty(2, 4, length, 64, device="meta", dtype=torch.bfloat16) for length in (40, 72))
    for keys, causal in ((k, False), (q, True)):
        out, lse = block_forward(name, q, keys, keys, causal=causal, scale=SCALE)
        assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
        grads = fused_backward(name, out, q, keys, keys, out, lse, causal=causal, scale=SCALE)
        assert [g.shape for g in grads] == [q.shape, keys.shape, keys.shape]
