"""Plain fp32 block attention with a materialised score matrix: the reference the fused kernels of
lightscale/parallel/context_parallel/kernels.py are checked against (what ring and allgather computed before)."""

from __future__ import annotations

import torch
from torch import Tensor


def block_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``q`` over ``k``/``v`` in fp32; ``causal``: the top-left lower-triangular mask."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v.float(), lse


def block_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(dq, dk, dv)`` of one block given the merged output, its gradient and log-sum-exp (flash attention's
    backward: ``P = exp(S - lse)``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O))``)."""
    q, k, v, grad = q.float(), k.float(), v.float(), grad.float()
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.exp(scores - lse.float().unsqueeze(-1))
    delta = (grad * out.float()).sum(-1, keepdim=True)
    dscores = probs * (grad @ v.transpose(-2, -1) - delta)
    return (dscores @ k) * scale, (dscores.transpose(-2, -1) @ q) * scale, probs.transpose(-2, -1) @ grad
