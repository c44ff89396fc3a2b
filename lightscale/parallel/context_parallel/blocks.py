"""Attention of query chunks against key/value chunks, merged by log-sum-exp: the arithmetic every mode shares.

Tokens come in chunks of the global sequence (:mod:`.layout`), each known by its global ``[start, end)``. Under a
causal mask a (query chunk, key chunk) pair is either skipped (every key after every query), computed in full
(every key before every query) or computed with the lower-triangular mask (the same chunk): skipping is what
makes the zigzag layout balanced. Each pair gives a partial output and the log-sum-exp of its scores; partials of
the same query rows merge exactly, in fp32::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Forward runs without autograd (:func:`attend`, :func:`finish`): the attention functions of :mod:`.attention` keep
only q, k, v, the merged output and its log-sum-exp for backward, and :func:`attend_backward` recomputes each
block's probabilities from the *final* log-sum-exp (flash attention's backward)::

    P = exp(S - lse)    dV = Pᵀ dO    dP = dO Vᵀ    dS = P ∘ (dP - rowsum(dO ∘ O))
    dQ = dS K·scale     dK = dSᵀ Q·scale

which is exact: ``P`` of a block under the final ``lse`` is that block's share of the merged softmax.
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


def finish(acc: list[Partial | None]) -> Partial:
    """The query chunks' outputs and log-sum-exps joined in local order (fp32)."""
    assert all(part is not None for part in acc), "a query chunk saw no key (its own chunk is always visible)"
    parts = [part for part in acc if part is not None]
    return Partial(torch.cat([p.out for p in parts], dim=-2), torch.cat([p.lse for p in parts], dim=-1))


def attends(q_ranges: list[Range], k_ranges: list[Range], *, causal: bool) -> bool:
    """Whether any query chunk attends to any of the key chunks (a ring step may have nothing to compute)."""
    return any(pair_kind(qr, kr, causal=causal) != "skip" for qr in q_ranges for kr in k_ranges)


class OutputGrad(NamedTuple):
    """What every block's backward needs of the merged output: its gradient ``dO``, ``delta = rowsum(dO ∘ O)`` and
    the final log-sum-exp (query rows in local order, fp32)."""

    grad: Tensor  # (..., Lq, Dv)
    delta: Tensor  # (..., Lq)
    lse: Tensor  # (..., Lq)

    def chunks(self, rows: list[int]) -> list[OutputGrad]:
        grads, deltas = self.grad.split(rows, dim=-2), self.delta.split(rows, dim=-1)
        return [OutputGrad(*part) for part in zip(grads, deltas, self.lse.split(rows, dim=-1), strict=True)]


def attend_backward(
    q: Tensor,
    q_ranges: list[Range],
    k: Tensor,
    v: Tensor,
    k_ranges: list[Range],
    output: OutputGrad,
    *,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 gradients (dq, dk, dv) of the merged attention's output through the key chunks of ``k``/``v`` (shapes
    as in :func:`attend`)."""
    rows = [end - start for start, end in q_ranges]
    q_chunks, out_chunks = q.float().split(rows, dim=-2), output.chunks(rows)
    sizes = [end - start for start, end in k_ranges]
    k_chunks, v_chunks = k.float().split(sizes, dim=-2), v.float().split(sizes, dim=-2)
    dq = [torch.zeros_like(chunk) for chunk in q_chunks]
    dk, dv = [torch.zeros_like(chunk) for chunk in k_chunks], [torch.zeros_like(chunk) for chunk in v_chunks]
    for i, (q_range, o) in enumerate(zip(q_ranges, out_chunks, strict=True)):
        for j, k_range in enumerate(k_ranges):
            kind = pair_kind(q_range, k_range, causal=causal)
            if kind == "skip":
                continue
            scores = (q_chunks[i] @ k_chunks[j].transpose(-2, -1)) * scale
            if kind == "diagonal":
                keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~keep, float("-inf"))
            probs = torch.exp(scores - o.lse.unsqueeze(-1))  # this block's share of the merged softmax
            dv[j] += probs.transpose(-2, -1) @ o.grad
            dscores = probs * (o.grad @ v_chunks[j].transpose(-2, -1) - o.delta.unsqueeze(-1))
            dq[i] += (dscores @ k_chunks[j]) * scale
            dk[j] += (dscores.transpose(-2, -1) @ q_chunks[i]) * scale
    return torch.cat(dq, dim=-2), torch.cat(dk, dim=-2), torch.cat(dv, dim=-2)
