"""Grouped GEMM for the routed experts equals the per-expert loop, forward and backward, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from experts_reference import loop_experts

from lightscale.layers.grouped_mm import check_expert_widths, grouped_mlp
from lightscale.layers.moe import MoE, MoEConfig

COUNTS = [5, 0, 11, 1, 0, 7]  # empty groups, a single row, sizes no alignment divides


def _grads(fn, tokens: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype, **kw) -> list:
    """The output and the gradients of tokens, w1 and w2 (in fp32) of ``fn`` run in ``dtype``."""
    leaves = [t.detach().clone().requires_grad_() for t in (tokens, w1, w2)]
    x, a, b = (leaf.to(dtype) for leaf in leaves)
    out = fn(x, torch.tensor(COUNTS), a, b, **kw)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out.float().detach(), *(leaf.grad for leaf in leaves)]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(sum(COUNTS), 16), torch.randn(len(COUNTS), 16, 32) / 4, torch.randn(len(COUNTS), 32, 16) / 6


@pytest.mark.parametrize("align", [1, 8])  # 1: the CPU layout; 8: CUDA's padded groups, run on CPU
def test_grouped_equals_loop_fp32(align: int) -> None:
    tokens, w1, w2 = _inputs()
    got = _grads(grouped_mlp, tokens, w1, w2, torch.float32, align=align)
    want = _grads(loop_experts, tokens, w1, w2, torch.float32)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("align", [1, 8])
def test_grouped_bf16_is_as_close_to_fp32_as_the_bf16_loop(align: int) -> None:
    tokens, w1, w2 = _inputs()
    exact = _grads(loop_experts, tokens, w1, w2, torch.float32)
    grouped = _grads(grouped_mlp, tokens, w1, w2, torch.bfloat16, align=align)
    loop = _grads(loop_experts, tokens, w1, w2, torch.bfloat16)
    for got, ref, want in zip(grouped, loop, exact, strict=True):  # output, d tokens, d w1, d w2
        assert (got - want).abs().max() <= 1.5 * (ref - want).abs().max() + 1e-3


def test_no_tokens_gives_zero_expert_gradients() -> None:
    w1 = torch.randn(3, 8, 16, requires_grad=True)
    out = grouped_mlp(torch.zeros(0, 8), torch.zeros(3, dtype=torch.long), w1, torch.randn(3, 16, 8))
    out.sum().backward()
    assert out.shape == (0, 8) and w1.grad is not None and not w1.grad.any()


def test_widths_grouped_gemm_cannot_take_are_refused() -> None:
    check_expert_widths(16, 64)
    with pytest.raises(ValueError, match=r"multiples of 8.*hidden=36"):
        MoE(16, MoEConfig(n_experts=2, hidden=36))
