"""Grouped GEMM on CUDA (bf16, groups padded to 8 rows) against the per-expert loop; skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
from experts_reference import loop_experts

from lightscale.layers.grouped_mm import CUDA_GROUP_ROWS, group_rows, grouped_mlp

pytestmark = pytest.mark.gpu


def test_cuda_grouped_gemm_pads_and_matches_the_loop() -> None:
    assert group_rows(torch.device("cuda")) == CUDA_GROUP_ROWS
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 11, 1, 0, 7], device="cuda")
    leaves = [torch.randn(24, 64), torch.randn(6, 64, 128) / 8, torch.randn(6, 128, 64) / 11]
    results = []
    for fn in (grouped_mlp, loop_experts):
        x, w1, w2 = (t.cuda().bfloat16().requires_grad_() for t in leaves)
        out = fn(x, counts, w1, w2)
        out.backward(torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out).bfloat16())
        results.append([out.float(), x.grad.float(), w1.grad.float(), w2.grad.float()])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
