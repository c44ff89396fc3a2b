"""Attention of query chunks against key/value chunks, merged by log-sum-exp: the arithmetic every mode shares.

Tokens come in chunks of the global sequence (:mod:`.layout`), each known by its global ``[start, end)``. Under a
causal mask a (query chunk, key chunk) pair is either skipped (every key after every query), computed in full
(every key before every query) or computed with the lower-triangular mask (the same chunk): skipping is what
makes the zigzag layout balanced. Each pair gives a partial output and the log-sum-exp of its scores; partials of
the same query rows merge exactly, in fp32::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Everything here is plain differentiable torch, so autograd gives exact gradients through blocks and merges.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

Range = tuple[int, int]


class Partial(NamedTuple):
    """Attention output of some query rows over a subset of the keys, and the log-sum-exp of those scores."""

    out: Tensor  # (..., Lq, Dv) fp32
    lse: Tensor  # (..., Lq) fp32


def block_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, diagonal: bool) -> Partial:
    """Softmax attention of ``q`` over ``k``/``v`` in fp32; ``diagonal``: q and k are the same chunk (causal)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * scale
    if diagonal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v.float()
    return Partial(out, lse)


def merge(a: Partial, b: Partial) -> Partial:
    """Exact softmax over the union of two disjoint key sets, from each set's output and log-sum-exp."""
    lse = torch.logaddexp(a.lse, b.lse)
    out = a.out * torch.exp(a.lse - lse).unsqueeze(-1) + b.out * torch.exp(b.lse - lse).unsqueeze(-1)
    return Partial(out, lse)


def pair_kind(q_range: Range, k_range: Range, *, causal: bool) -> str:
    """``"skip"``, ``"full"`` or ``"diagonal"`` for a query chunk against a key chunk."""
    if not causal or k_range[1] <= q_range[0]:
        return "full"
    if k_range[0] >= q_range[1]:
        return "skip"
    assert k_range == q_range, (q_range, k_range)  # chunks are aligned and of one size: overlap means the same
    return "diagonal"


def attend(
    q: Tensor,
    q_ranges: list[Range],
    k: Tensor,
    v: Tensor,
    k_ranges: list[Range],
    acc: list[Partial | None],
    *,
    causal: bool,
    scale: float,
) -> list[Partial | None]:
    """Merge into ``acc`` (one entry per query chunk) the attention of each query chunk over the key chunks.

    ``q`` is ``(B, H, Lq, D)``, ``k``/``v`` ``(B, H, Lk, D)`` with the chunks laid end to end along dim -2.
    """
    q_chunks = q.split([end - start for start, end in q_ranges], dim=-2)
    sizes = [end - start for start, end in k_ranges]
    kv_chunks = list(zip(k.split(sizes, dim=-2), v.split(sizes, dim=-2), k_ranges, strict=True))
    acc = list(acc)
    for i, (q_chunk, q_range) in enumerate(zip(q_chunks, q_ranges, strict=True)):
        for k_chunk, v_chunk, k_range in kv_chunks:
            kind = pair_kind(q_range, k_range, causal=causal)
            if kind == "skip":
                continue
            part = block_attention(q_chunk, k_chunk, v_chunk, scale=scale, diagonal=kind == "diagonal")
            acc[i] = part if acc[i] is None else merge(acc[i], part)
    return acc


def finish(acc: list[Partial | None], dtype: torch.dtype) -> Tensor:
    """The query chunks' outputs joined in local order, in the inputs' dtype."""
    assert all(part is not None for part in acc), "a query chunk saw no key (its own chunk is always visible)"
    return torch.cat([part.out for part in acc if part is not None], dim=-2).to(dtype)
