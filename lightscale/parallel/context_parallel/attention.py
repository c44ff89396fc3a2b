"""Exact attention over a sequence sharded across the ranks of a context-parallel group: three modes.

Each rank holds two chunks of the sequence (:mod:`.layout`) for q, k and v, shaped ``(batch, heads, seq, dim)``.

- ``ring``: the K/V block travels around the ring, ``cp - 1`` point-to-point hops; the next hop is in flight while
  the current block is computed. Backward sends the K/V blocks around again (``cp - 1`` hops) with the dK/dV
  accumulated for each block travelling one hop behind it (``cp`` hops: the last one brings each rank its own),
  both in flight while the next block's gradients are computed.
  Saved for backward: this rank's q, k, v, output and log-sum-exp only (ring-flash-attention's design).
- ``allgather``: K/V gathered once per layer (one all-gather), put in sequence order, attended in a few calls;
  backward reduce-scatters dK/dV. Saved for backward: the whole sequence's K/V (no second gather), q, the output and
  log-sum-exp.
- ``ulysses``: all-to-all from sequence shards to head shards for q, k and v, torch's own (fused)
  ``scaled_dot_product_attention`` over the whole sequence on ``H / cp`` heads, all-to-all of the output back;
  backward the four reverse all-to-alls. Heads must divide by cp.

Ring and allgather compute blocks without autograd, each by torch's fused SDPA op that returns the log-sum-exp
(:mod:`.kernels`: flash-for-CPU on CPU; flash, memory-efficient or cuDNN on CUDA), and merge them by log-sum-exp in
fp32 (:mod:`.blocks`); their backward is written out (an autograd function each): every block's backward op takes
the merged output and log-sum-exp, so no block's score matrix is ever kept (memory O(local tokens), not O(block²)).

Example:
    >>> out = context_parallel_attention(q, k, v, group, mode="ring", is_causal=True)
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightscale.errors import ConfigurationError
from lightscale.parallel.context_parallel.blocks import (
    OutputGrad,
    Partial,
    Range,
    attend,
    attend_backward,
    attends,
    finish,
)
from lightscale.parallel.context_parallel.comm import (
    Pending,
    all_gather_along,
    all_to_all_heads,
    all_to_all_sequence,
    reduce_scatter_along,
    send_to_next,
)
from lightscale.parallel.context_parallel.kernels import choose_kernel
from lightscale.parallel.context_parallel.token_split import (
    Layout,
    check_sequence_length,
    chunk_ranges,
    local_positions,
)

Mode = Literal["ring", "allgather", "ulysses"]
_KV, _DKV = 0, 1  # point-to-point tags: a K/V hop and a dK/dV hop may be in flight between the same ranks
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
    if mode == "ulysses":
        return _ulysses(q, k, v, group, seq_len, layout=layout, causal=is_causal, scale=scale, gqa=enable_gqa)
    shape = _Shape(group, seq_len, layout, is_causal, scale)
    shape.kernel = choose_kernel(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]))
    function = _RingAttention if mode == "ring" else _AllGatherAttention
    return function.apply(q, k, v, shape)


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


class _Shape:
    """What both autograd functions need besides q, k, v (one argument: autograd passes it through)."""

    def __init__(self, group: ProcessGroup, seq_len: int, layout: Layout, causal: bool, scale: float) -> None:
        self.group, self.seq_len, self.layout, self.causal, self.scale = group, seq_len, layout, causal, scale
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.kernel = "flash_cpu"  # the fused op of every block (kernels.choose_kernel)

    @property
    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~.blocks.attend` and :func:`~.blocks.attend_backward`."""
        return {"causal": self.causal, "scale": self.scale, "kernel": self.kernel}

    def ranges(self, rank: int) -> list[Range]:
        return chunk_ranges(self.seq_len, self.cp, rank, self.layout)

    def all_ranges(self) -> list[Range]:
        """Chunk ranges of the whole sequence as gathered in rank order."""
        return [chunk for rank in range(self.cp) for chunk in self.ranges(rank)]

    def in_order(self, gathered: Tensor) -> Tensor:
        """The chunks of a tensor gathered in rank order (along dim -2) put in sequence order: each query chunk then
        sees the keys before it as one run (one kernel call)."""
        chunks = dict(zip(self.all_ranges(), gathered.chunk(2 * self.cp, dim=-2), strict=True))
        return torch.cat([chunks[r] for r in sorted(chunks)], dim=-2)

    def in_rank_order(self, ordered: Tensor) -> Tensor:
        """The inverse of :meth:`in_order`."""
        chunks = dict(zip(sorted(self.all_ranges()), ordered.chunk(2 * self.cp, dim=-2), strict=True))
        return torch.cat([chunks[r] for r in self.all_ranges()], dim=-2)


def _expand(kv: Tensor, heads: int) -> Tensor:
    """Repeat grouped key/value heads to the query's heads (enable_gqa), after communication."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: Tensor, kv_heads: int) -> Tensor:
    """The transpose of :func:`_expand`: a gradient over the query's heads summed back onto the grouped heads."""
    heads = grad.shape[1]
    return grad if heads == kv_heads else grad.unflatten(1, (kv_heads, heads // kv_heads)).sum(2)


def _kv_blocks(kv: Tensor, k_dim: int, heads: int) -> tuple[Tensor, Tensor]:
    k, v = kv.split([k_dim, kv.shape[-1] - k_dim], dim=-1)
    return _expand(k, heads), _expand(v, heads)


def _output_grad(grad: Tensor, out: Tensor, lse: Tensor) -> OutputGrad:
    return OutputGrad(grad.to(out.dtype), out, lse)


def sdpa_layout(out: Tensor, dtype: torch.dtype) -> Tensor:
    """``out (B, H, L, D)`` in ``dtype``, laid out in memory as ``(B, L, H, D)`` like torch's own attention output:
    the usual ``out.transpose(1, 2).reshape(B, L, H * D)`` is then a view, and the tensor saved here for backward is
    the one the next layer saves (no second copy of the output)."""
    return out.transpose(1, 2).to(dtype).contiguous().transpose(1, 2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, shape: _Shape) -> Tensor:
        q_ranges, heads = shape.ranges(shape.rank), q.shape[1]
        kv = torch.cat([k, v], dim=-1)  # one message per hop
        acc: list[Partial | None] = [None] * len(q_ranges)
        pending = Pending()
        for step in range(shape.cp):
            incoming = send_to_next(kv, shape.group, pending, tag=_KV) if step < shape.cp - 1 else None
            k_ranges = shape.ranges((shape.rank - step) % shape.cp)
            if attends(q_ranges, k_ranges, causal=shape.causal):
                block_k, block_v = _kv_blocks(kv, k.shape[-1], heads)
                acc = attend(q, q_ranges, block_k, block_v, k_ranges, acc, **shape.options)
            pending.wait()
            kv = incoming
        merged = finish(acc)
        out = sdpa_layout(merged.out, q.dtype)
        ctx.save_for_backward(q, k, v, out, merged.lse)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        shape: _Shape = ctx.shape
        q_ranges, output = shape.ranges(shape.rank), _output_grad(grad, out, lse)
        dq = torch.zeros_like(q, dtype=lse.dtype)
        kv = torch.cat([k, v], dim=-1)
        mine = torch.zeros_like(kv, dtype=lse.dtype)  # this rank's gradient of the block it holds
        dkv = mine  # the gradient of the block held, from every rank it visited; travels one hop behind it
        kv_hop, dkv_hop = Pending(), Pending()
        for step in range(shape.cp):
            incoming = send_to_next(kv, shape.group, kv_hop, tag=_KV) if step < shape.cp - 1 else None
            k_ranges = shape.ranges((shape.rank - step) % shape.cp)
            computed = attends(q_ranges, k_ranges, causal=shape.causal)
            if computed:
                _backward_into(q, q_ranges, kv, k_ranges, output, dq, mine, shape, k_dims=(k.shape[1], k.shape[-1]))
            dkv_hop.wait()  # the previous rank's gradient of this block arrived while this one's was computed
            if step > 0 and computed:
                dkv += mine
            # The block moves on to the next rank with its gradient so far; after cp moves each is home.
            sent, dkv = dkv, send_to_next(dkv, shape.group, dkv_hop, tag=_DKV)
            if sent is mine:  # in flight: the next steps need a buffer of their own
                mine = torch.zeros_like(mine)
            kv_hop.wait()
            kv = incoming
        dkv_hop.wait()
        dk, dv = dkv.split([k.shape[-1], v.shape[-1]], dim=-1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _backward_into(
    q: Tensor,
    q_ranges: list[Range],
    kv: Tensor,
    k_ranges: list[Range],
    output: OutputGrad,
    dq: Tensor,
    dkv: Tensor,
    shape: _Shape,
    *,
    k_dims: tuple[int, int],
) -> None:
    """Add this block's gradients into ``dq`` and ``dkv`` (zeroed first: it holds one block's gradient); grouped
    key/value heads get their gradients summed from the query heads'."""
    (k_heads, k_dim), heads = k_dims, q.shape[1]
    block_k, block_v = _kv_blocks(kv, k_dim, heads)
    dkv.zero_()
    dk, dv = dkv.split([k_dim, dkv.shape[-1] - k_dim], dim=-1)
    if k_heads == heads:
        attend_backward(q, q_ranges, block_k, block_v, k_ranges, output, (dq, dk, dv), **shape.options)
        return
    dk_heads, dv_heads = torch.zeros_like(block_k, dtype=dq.dtype), torch.zeros_like(block_v, dtype=dq.dtype)
    attend_backward(q, q_ranges, block_k, block_v, k_ranges, output, (dq, dk_heads, dv_heads), **shape.options)
    dk += _fold(dk_heads, k_heads)
    dv += _fold(dv_heads, k_heads)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, shape: _Shape) -> Tensor:
        kv = shape.in_order(all_gather_along(torch.cat([k, v], dim=-1), shape.group, dim=-2))
        full_k, full_v = _kv_blocks(kv, k.shape[-1], q.shape[1])
        acc: list[Partial | None] = [None, None]
        q_ranges, k_ranges = shape.ranges(shape.rank), sorted(shape.all_ranges())
        merged = finish(attend(q, q_ranges, full_k, full_v, k_ranges, acc, **shape.options))
        out = sdpa_layout(merged.out, q.dtype)
        ctx.save_for_backward(q, kv, out, merged.lse)  # the whole sequence's K/V: no second gather
        ctx.shape, ctx.k_dims = shape, (k.shape[1], k.shape[-1])
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, kv, out, lse = ctx.saved_tensors
        shape: _Shape = ctx.shape
        k_dim = ctx.k_dims[1]
        q_ranges, k_ranges = shape.ranges(shape.rank), sorted(shape.all_ranges())
        output, dq = _output_grad(grad, out, lse), torch.zeros_like(q, dtype=lse.dtype)
        dkv = torch.zeros_like(kv, dtype=lse.dtype)
        _backward_into(q, q_ranges, kv, k_ranges, output, dq, dkv, shape, k_dims=ctx.k_dims)
        dkv = reduce_scatter_along(shape.in_rank_order(dkv), shape.group, dim=-2)
        dk, dv = dkv.split([k_dim, dkv.shape[-1] - k_dim], dim=-1)
        return dq.to(q.dtype), dk.to(kv.dtype), dv.to(kv.dtype), None


def _ulysses(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: ProcessGroup,
    seq_len: int,
    *,
    layout: Layout,
    causal: bool,
    scale: float,
    gqa: bool,
) -> Tensor:
    cp = dist.get_world_size(group)
    head_q, head_k, head_v = (all_to_all_heads(t, group) for t in (q, k, v))
    # The gathered sequence is in rank order (each rank's chunks): put it in order for torch's attention and back.
    gathered = torch.cat([local_positions(seq_len, cp, rank, layout) for rank in range(cp)]).to(q.device)
    in_order = torch.argsort(gathered)
    head_q, head_k, head_v = (t.index_select(2, in_order) for t in (head_q, head_k, head_v))
    out = F.scaled_dot_product_attention(head_q, head_k, head_v, is_causal=causal, scale=scale, enable_gqa=gqa)
    return all_to_all_sequence(out.index_select(2, gathered), group)
