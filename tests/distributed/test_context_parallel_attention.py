"""Context-parallel attention equals full-sequence attention: outputs, input gradients, a tiny transformer's loss and
parameter gradients, in every mode; planted errors fail by far; exact bytes per layer per rank."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.parallel.context_parallel import (
    MODES,
    ContextParallelAttention,
    blocks,
    gather_sequence,
    local_positions,
    shard_sequence,
)
from lightscale.testing import run_distributed

BOUND = 1e-5
SHAPE = (2, 4, 16, 8)  # batch, heads, sequence, head dim


def _relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _attention_errors(
    mode: str, causal: bool, *, layout: str = "zigzag", gathered_layout: str | None = None, gqa: bool = False
) -> list[float]:
    """Relative error of the output and dq, dk, dv of one attention call against the full sequence.

    ``gqa``: half as many key/value heads as query heads, and a non-default scale.
    """
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    kv_shape = (SHAPE[0], SHAPE[1] // 2, *SHAPE[2:]) if gqa else SHAPE
    q, k, v = (torch.randn(shape, requires_grad=True) for shape in (SHAPE, kv_shape, kv_shape))
    grad = torch.randn(SHAPE)
    options = dict(is_causal=causal, enable_gqa=gqa, scale=0.3 if gqa else None)
    reference = F.scaled_dot_product_attention(q, k, v, **options)
    (reference * grad).sum().backward()
    local = [shard_sequence(t.detach(), cp, rank, dim=2, layout=layout).requires_grad_() for t in (q, k, v)]
    with ContextParallelAttention(mode=mode, layout=layout):
        out = F.scaled_dot_product_attention(*local, **options)
    (out * shard_sequence(grad, cp, rank, dim=2, layout=layout)).sum().backward()
    ours = [out.detach(), *(t.grad for t in local)]
    full = [gather_sequence(t, dim=2, layout=gathered_layout or layout) for t in ours]
    return [_relative(a, b) for a, b in zip(full, [reference, q.grad, k.grad, v.grad], strict=True)]


def _every_mode() -> dict[tuple[str, bool, bool], list[float]]:
    cases = [(mode, causal, False) for mode in MODES for causal in (True, False)]
    cases += [(mode, True, True) for mode in MODES]
    return {(mode, causal, gqa): _attention_errors(mode, causal, gqa=gqa) for mode, causal, gqa in cases}


def test_attention_and_gradients_match_full_sequence_cp2() -> None:
    errors = run_distributed(_every_mode, world_size=2)[0]
    assert max(max(e) for e in errors.values()) < BOUND, errors


def _ring_both_layouts() -> list[float]:
    # Contiguous: rank 0 relays blocks it never attends to; their gradient hops must still run.
    return _attention_errors("ring", True) + _attention_errors("ring", True, layout="contiguous")


def test_attention_and_gradients_match_full_sequence_cp4() -> None:
    errors = run_distributed(_ring_both_layouts, world_size=4)[0]
    assert max(errors) < BOUND, errors


def _bf16_errors(mode: str, causal: bool) -> tuple[list[float], list[float]]:
    """Relative errors against fp32 attention of one process: of cp attention in bf16 (output, dq, dk, dv), and of
    one process's own bf16 attention (the yardstick)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    shape = (1, 4, 128, 32)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (reference * grad).sum().backward()
    expected = [reference.detach(), q.grad, k.grad, v.grad]
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    one = F.scaled_dot_product_attention(*half, is_causal=causal)
    (one * grad.bfloat16()).sum().backward()
    one_process = [one.detach(), *(t.grad for t in half)]
    yardstick = [_relative(a.float(), b) for a, b in zip(one_process, expected, strict=True)]
    local = [shard_sequence(t, cp, rank, dim=2).detach().requires_grad_() for t in half]
    with ContextParallelAttention(mode=mode):
        out = F.scaled_dot_product_attention(*local, is_causal=causal)
    (out * shard_sequence(grad.bfloat16(), cp, rank, dim=2)).sum().backward()
    ours = [gather_sequence(t, dim=2).float() for t in [out.detach(), *(t.grad for t in local)]]
    return [_relative(a, b) for a, b in zip(ours, expected, strict=True)], yardstick


def _bf16_cases() -> dict[tuple[str, bool], tuple[list[float], list[float]]]:
    return {(mode, causal): _bf16_errors(mode, causal) for mode in ("ring", "allgather") for causal in (True, False)}


def test_bf16_within_one_process_bf16_error() -> None:
    # Blocks run in bf16 and merge in fp32: the output is as close to fp32 as one process's bf16 attention. Each
    # rank's dK/dV of a block is rounded to bf16 by the kernel before the fp32 sum over ranks (torch's own
    # context_parallel does the same), so a key/value gradient carries up to cp roundings instead of one.
    errors = run_distributed(_bf16_cases, world_size=2)[0]
    for (mode, causal), (ours, yardstick) in errors.items():
        assert ours[0] <= yardstick[0] and max(ours) <= 1.25 * max(yardstick), (mode, causal, ours, yardstick)


def _average(a: blocks.Partial, b: blocks.Partial) -> blocks.Partial:
    return blocks.Partial((a.out + b.out) / 2, torch.logaddexp(a.lse, b.lse))


def _planted() -> tuple[float, float]:
    with mock.patch.object(blocks, "merge", _average):
        no_lse = max(_attention_errors("ring", True))
    return no_lse, max(_attention_errors("ring", True, gathered_layout="contiguous"))


def test_planted_errors_fail_by_far() -> None:
    no_lse, not_unpermuted = run_distributed(_planted, world_size=2)[0]
    assert no_lse > 100 * BOUND and not_unpermuted > 100 * BOUND, (no_lse, not_unpermuted)


class TinyTransformer(nn.Module):
    """Two pre-norm blocks calling F.scaled_dot_product_attention, learned positions fed by the caller."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos(positions)
        for qkv, proj, norm in zip(self.qkv, self.proj, self.norm, strict=True):
            b, s, d = x.shape
            q, k, v = qkv(norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(att.transpose(1, 2).reshape(b, s, d))
        return self.head(x)


def _model_errors() -> dict[str, float]:
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer()
    data = torch.randint(0, 32, (2, 33))
    inputs, labels = data[:, :-1], data[:, 1:]  # shifted before sharding
    logits = model(inputs, torch.arange(inputs.shape[1]))
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref_grads = torch.autograd.grad(reference, list(model.parameters()))
    errors = {}
    for mode in MODES:
        with ContextParallelAttention(mode=mode) as attention:
            logits = model(shard_sequence(inputs, cp, rank), local_positions(inputs.shape[1], cp, rank))
        local = shard_sequence(labels, cp, rank)
        loss = F.cross_entropy(logits.flatten(0, 1), local.flatten(), reduction="sum") / labels.numel()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for t in (loss, *grads):
            dist.all_reduce(t)
        assert attention.calls == 2
        worst = max(_relative(a, b) for a, b in zip(grads, ref_grads, strict=True))
        errors[mode] = max(_relative(loss, reference), worst)
    return errors


def test_tiny_transformer_loss_and_gradients_match() -> None:
    errors = run_distributed(_model_errors, world_size=2)[0]
    assert max(errors.values()) < BOUND, errors


def _traffic(mode: str) -> dict[str, tuple[int, int]]:
    """Calls and bytes per collective kind of one attention layer, forward and backward, on this rank."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    local = [torch.randn(SHAPE).chunk(cp, dim=2)[rank].contiguous().requires_grad_() for _ in range(3)]
    with CollectiveCounter() as counter, ContextParallelAttention(mode=mode):
        F.scaled_dot_product_attention(*local, is_causal=True).sum().backward()
    return {kind: (t.calls, t.bytes) for kind, t in counter.totals().items()}


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_per_layer_per_rank_equal_theory(cp: int) -> None:
    block = SHAPE[0] * SHAPE[1] * SHAPE[2] // cp * SHAPE[3] * 4  # bytes of one local q, k, v or output
    theory = {
        # K and V travel as one message per hop: cp - 1 hops forward; backward they travel again (cp - 1 hops) and
        # their gradients one hop behind them (cp hops, fp32 here like the inputs).
        "ring": {"send": (3 * cp - 2, (3 * cp - 2) * 2 * block), "recv": (3 * cp - 2, (3 * cp - 2) * 2 * block)},
        # One all-gather of K and V (the counter reports the gathered buffer: cp blocks each, (cp - 1) of them
        # sent by this rank) and one reduce-scatter of dK, dV (its input buffer).
        "allgather": {"all_gather": (1, cp * 2 * block), "reduce_scatter": (1, cp * 2 * block)},
        # q, k, v to heads and the output back, forward and backward: 8 all-to-alls of one local block each,
        # (cp - 1) / cp of it leaving the rank.
        "ulysses": {"all_to_all": (8, 8 * block)},
    }
    measured = run_distributed(_measure_all_modes, world_size=cp)
    for rank_traffic in measured:
        assert rank_traffic == theory, (rank_traffic, theory)


def _measure_all_modes() -> dict[str, dict[str, tuple[int, int]]]:
    return {mode: _traffic(mode) for mode in MODES}
