"""Attention of query chunks against key/value chunks by a fused SDPA op, merged by log-sum-exp: the arithmetic ring
and allgather share.

Tokens come in chunks of the global sequence (:mod:`.layout`), each known by its global ``[start, end)``. Under a
causal mask a (query chunk, key chunk) pair is either skipped (every key after every query), computed in full
(every key before every query) or computed with the causal mask (the same chunk): skipping is what makes the zigzag
layout balanced. :func:`plan` groups the pairs into as few kernel calls as the mask allows (a rank's own chunks in
one causal call; a rectangle of full pairs in one call), each by the fused op of :mod:`.kernels`, which returns the
output and the log-sum-exp of its scores without keeping a score matrix. Partials of the same query rows merge
exactly, in fp32::

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Forward runs without autograd (:func:`attend`, :func:`finish`): the attention functions of :mod:`.attention` keep
only q, k, v, the merged output and its log-sum-exp for backward, and :func:`attend_backward` runs each call's
backward op with the *merged* output and log-sum-exp (flash attention's backward recomputes ``P = exp(S - lse)``
inside the kernel), which is exact: ``P`` of a block under the final ``lse`` is that block's share of the merged
softmax. The plain fp32 arithmetic these kernels replace is the reference of the tests (tests/attention_reference.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightscale.parallel.context_parallel.kernels import block_backward, block_forward

Range = tuple[int, int]


class Partial(NamedTuple):
    """Attention output of some query rows over a subset of the keys, and the log-sum-exp of those scores."""

    out: Tensor  # (..., Lq, Dv) fp32
    lse: Tensor  # (..., Lq) fp32


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


class Call(NamedTuple):
    """One kernel call: query chunks ``[q_first, q_end)`` against key chunks ``[k_first, k_end)`` (local indices)."""

    q_first: int
    q_end: int
    k_first: int
    k_end: int
    causal: bool


def plan(q_ranges: list[Range], k_ranges: list[Range], *, causal: bool) -> list[Call]:
    """The kernel calls that cover every non-skipped (query chunk, key chunk) pair exactly once."""
    if causal and q_ranges == k_ranges and q_ranges == sorted(q_ranges):
        # A rank's own chunks, in ascending order: the top-left causal mask over them is the global one.
        return [Call(0, len(q_ranges), 0, len(k_ranges), True)]
    calls: list[Call] = []
    for i, q_range in enumerate(q_ranges):
        kinds = [pair_kind(q_range, k_range, causal=causal) for k_range in k_ranges]
        j = 0
        while j < len(kinds):
            end = j + 1
            while kinds[j] == "full" and end < len(kinds) and kinds[end] == "full":
                end += 1  # a run of full key chunks: one call
            if kinds[j] != "skip":
                calls.append(Call(i, i + 1, j, end, kinds[j] == "diagonal"))
            j = end
    return _join_rows(calls)


def _join_rows(calls: list[Call]) -> list[Call]:
    """Adjacent query chunks that see the same key chunks in full share one call (the ring's rectangles)."""
    joined: list[Call] = []
    for call in calls:
        last = joined[-1] if joined else None
        same_keys = last is not None and (last.k_first, last.k_end) == (call.k_first, call.k_end)
        if same_keys and last is not None and not (last.causal or call.causal) and last.q_end == call.q_first:
            joined[-1] = last._replace(q_end=call.q_end)
        else:
            joined.append(call)
    return joined


def _offsets(ranges: list[Range]) -> list[int]:
    """Where each chunk starts along the local sequence dimension, and the end."""
    offsets = [0]
    for start, end in ranges:
        offsets.append(offsets[-1] + end - start)
    return offsets


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for the merge and the gradient sums (fp64 inputs stay fp64)."""
    return torch.promote_types(dtype, torch.float32)


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
    kernel: str,
) -> list[Partial | None]:
    """Merge into ``acc`` (one entry per query chunk) the attention of each query chunk over the key chunks.

    ``q`` is ``(B, H, Lq, D)``, ``k``/``v`` ``(B, H, Lk, D)`` with the chunks laid end to end along dim -2.
    """
    acc, dtype = list(acc), accumulation_dtype(q.dtype)
    qo, ko = _offsets(q_ranges), _offsets(k_ranges)
    for call in plan(q_ranges, k_ranges, causal=causal):
        rows, keys = slice(qo[call.q_first], qo[call.q_end]), slice(ko[call.k_first], ko[call.k_end])
        q_rows, k_rows, v_rows = q[..., rows, :], k[..., keys, :], v[..., keys, :]
        out, lse = block_forward(kernel, q_rows, k_rows, v_rows, causal=call.causal, scale=scale)
        chunks = range(call.q_first, call.q_end)
        sizes = [qo[i + 1] - qo[i] for i in chunks]
        for i, part_out, part_lse in zip(chunks, out.split(sizes, -2), lse.split(sizes, -1), strict=True):
            part = Partial(part_out.to(dtype), part_lse.to(dtype))
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
    """What every block's backward needs of the merged output: the output, its gradient (both in the inputs'
    dtype, laid out alike) and the merged log-sum-exp (query rows in local order)."""

    grad: Tensor  # (..., Lq, Dv)
    out: Tensor  # (..., Lq, Dv)
    lse: Tensor  # (..., Lq)


def attend_backward(
    q: Tensor,
    q_ranges: list[Range],
    k: Tensor,
    v: Tensor,
    k_ranges: list[Range],
    output: OutputGrad,
    grads: tuple[Tensor, Tensor, Tensor],
    *,
    causal: bool,
    scale: float,
    kernel: str,
) -> None:
    """Add into ``grads`` (dq, dk, dv: fp32, shaped as q, k and v) the gradients of the merged attention's output
    through the key chunks of ``k``/``v`` (shapes as in :func:`attend`); adding in place keeps no per-block copies."""
    qo, ko = _offsets(q_ranges), _offsets(k_ranges)
    for call in plan(q_ranges, k_ranges, causal=causal):
        rows, keys = slice(qo[call.q_first], qo[call.q_end]), slice(ko[call.k_first], ko[call.k_end])
        block = block_backward(
            kernel,
            output.grad[..., rows, :],
            q[..., rows, :],
            k[..., keys, :],
            v[..., keys, :],
            output.out[..., rows, :],
            output.lse[..., rows],
            causal=call.causal,
            scale=scale,
        )
        grads[0][..., rows, :] += block[0]
        grads[1][..., keys, :] += block[1]
        grads[2][..., keys, :] += block[2]
