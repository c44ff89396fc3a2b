"""Exact attention over a sequence sharded across the ranks of a context-parallel group: three modes.

Each rank holds two chunks of the sequence (:mod:`.layout`) for q, k and v, shaped ``(batch, heads, seq, dim)``.

- ``ring``: the K/V block travels around the ring, ``cp - 1`` point-to-point hops; the next hop is in flight while
  the current block is computed. Backward sends each hop's dK/dV back the other way (``cp - 1`` hops).
- ``allgather``: K/V gathered once per layer (one all-gather), attended in one pass; backward reduce-scatters
  dK/dV. More memory (the whole K/V on every rank), fewer and larger messages.
- ``ulysses``: all-to-all from sequence shards to head shards for q, k and v, full-sequence attention on ``H / cp``
  heads, all-to-all of the output back; backward the four reverse all-to-alls. Heads must divide by cp.

Backward design: every mode is plain differentiable torch. Blocks are computed by a differentiable block function
that also returns the log-sum-exp, and merged by differentiable log-sum-exp arithmetic (:mod:`.blocks`); the
communication is autograd-aware (:mod:`.comm`: a send/recv whose backward sends the gradient back, an all-gather
whose backward is a reduce-scatter, an all-to-all whose backward is the reverse all-to-all). Autograd then gives
exact gradients; the cost against ring-flash-attention's hand-written backward is memory: every received K/V
block and its score matrix stay saved until backward instead of being recomputed from the saved log-sum-exp.

Example:
    >>> out = context_parallel_attention(q, k, v, group, mode="ring", is_causal=True)
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightscale.errors import ConfigurationError
from lightscale.parallel.context_parallel.blocks import Partial, Range, attend, finish, pair_kind
from lightscale.parallel.context_parallel.comm import (
    Pending,
    all_gather_sequence,
    all_to_all_heads,
    all_to_all_sequence,
    ring_shift,
)
from lightscale.parallel.context_parallel.layout import Layout, check_sequence_length, chunk_ranges

Mode = Literal["ring", "allgather", "ulysses"]
MODES: tuple[str, ...] = ("ring", "allgather", "ulysses")


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: ProcessGroup,
    *,
    mode: Mode = "ring",
    layout: Layout = "zigzag",
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., scale=..., enable_gqa=...)`` of the full sequence,
    restricted to this rank's tokens; q, k and v are this rank's shards in ``layout``."""
    cp = dist.get_world_size(group)
    _check(q, k, v, cp=cp, mode=mode, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seq_len = q.shape[-2] * cp
    if mode == "ring":
        return _ring(q, k, v, group, seq_len, layout=layout, causal=is_causal, scale=scale)
    if mode == "allgather":
        return _allgather(q, k, v, group, seq_len, layout=layout, causal=is_causal, scale=scale)
    return _ulysses(q, k, v, group, seq_len, layout=layout, causal=is_causal, scale=scale)


def _check(q: Tensor, k: Tensor, v: Tensor, *, cp: int, mode: str, enable_gqa: bool) -> None:
    if mode not in MODES:
        raise ConfigurationError(f"Unknown context-parallel attention mode {mode!r}; valid: {list(MODES)}.")
    if not q.dim() == k.dim() == v.dim() == 4:
        shapes = [tuple(t.shape) for t in (q, k, v)]
        raise ConfigurationError(f"Context-parallel attention needs (batch, heads, seq, dim) tensors; got {shapes}.")
    if k.shape[-2] != q.shape[-2]:
        raise ConfigurationError(
            f"Context-parallel attention is self-attention over one sharded sequence: query has {q.shape[-2]} "
            f"local tokens, key {k.shape[-2]} (cross-attention and KV caches are not supported)."
        )
    check_sequence_length(q.shape[-2] * cp, cp)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        raise ConfigurationError(
            f"Query has {heads} heads and key/value {kv_heads}: pass enable_gqa=True with query heads a multiple "
            f"of key/value heads."
        )
    if mode == "ulysses" and (heads % cp or kv_heads % cp):
        raise ConfigurationError(
            f"Ulysses context parallelism splits heads over cp={cp} ranks: query heads ({heads}) and key/value "
            f"heads ({kv_heads}) must divide by {cp}; use mode='ring' or 'allgather'."
        )


def _expand(kv: Tensor, heads: int) -> Tensor:
    """Repeat grouped key/value heads to the query's heads (enable_gqa), after communication."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _ring(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, seq_len: int, *, layout: Layout, causal: bool, scale: float
) -> Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q_ranges = chunk_ranges(seq_len, cp, rank, layout)
    kv = torch.cat([k, v], dim=-1)  # one message per hop
    acc: list[Partial | None] = [None, None]
    unused: list[Tensor] = []
    pending = Pending()
    for step in range(cp):
        incoming = ring_shift(kv, group, pending) if step < cp - 1 else None
        k_ranges = chunk_ranges(seq_len, cp, (rank - step) % cp, layout)
        if all(pair_kind(qr, kr, causal=causal) == "skip" for qr in q_ranges for kr in k_ranges):
            unused.append(kv)
        else:
            block_k, block_v = (_expand(t, q.shape[1]) for t in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
            acc = attend(q, q_ranges, block_k, block_v, k_ranges, acc, causal=causal, scale=scale)
        pending.wait()
        kv = incoming
    return _keep_in_graph(finish(acc, q.dtype), unused)


def _keep_in_graph(out: Tensor, unused: list[Tensor]) -> Tensor:
    """Tie blocks this rank relayed but never attended to (contiguous layout) into the graph with weight 0.

    Their ring hops must still run backward on this rank, or its neighbours wait forever for the gradient.
    """
    for block in unused:
        out = out + 0.0 * block.sum()
    return out


def _allgather(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, seq_len: int, *, layout: Layout, causal: bool, scale: float
) -> Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kv = all_gather_sequence(torch.cat([k, v], dim=-1), group, dim=-2)
    full_k, full_v = (_expand(t, q.shape[1]) for t in kv.split([k.shape[-1], v.shape[-1]], dim=-1))
    k_ranges = _all_ranges(seq_len, cp, layout)
    acc = attend(
        q, chunk_ranges(seq_len, cp, rank, layout), full_k, full_v, k_ranges, [None, None], causal=causal, scale=scale
    )
    return finish(acc, q.dtype)


def _ulysses(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, seq_len: int, *, layout: Layout, causal: bool, scale: float
) -> Tensor:
    cp = dist.get_world_size(group)
    head_q, head_k, head_v = (all_to_all_heads(t, group) for t in (q, k, v))
    ranges = _all_ranges(seq_len, cp, layout)
    head_k, head_v = _expand(head_k, head_q.shape[1]), _expand(head_v, head_q.shape[1])
    acc = attend(head_q, ranges, head_k, head_v, ranges, [None] * len(ranges), causal=causal, scale=scale)
    return all_to_all_sequence(finish(acc, q.dtype), group)


def _all_ranges(seq_len: int, cp: int, layout: Layout) -> list[Range]:
    """Chunk ranges of the whole sequence as gathered in rank order."""
    return [chunk for rank in range(cp) for chunk in chunk_ranges(seq_len, cp, rank, layout)]
