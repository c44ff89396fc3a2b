"""The zigzag layout and the refusals of context-parallel attention, in one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightscale.errors import ConfigurationError
from lightscale.parallel.context_parallel import (
    ContextParallelAttention,
    check_sequence_length,
    chunk_ranges,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from lightscale.parallel.context_parallel.attention import _check
from lightscale.parallel.context_parallel.blocks import pair_kind


def test_zigzag_gives_each_rank_a_head_and_a_tail_chunk() -> None:
    assert [chunk_ranges(16, 4, rank) for rank in range(4)] == [
        [(0, 2), (14, 16)],
        [(2, 4), (12, 14)],
        [(4, 6), (10, 12)],
        [(6, 8), (8, 10)],
    ]
    assert chunk_ranges(8, 2, 1, layout="contiguous") == [(4, 6), (6, 8)]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_then_unshard_is_the_identity(cp: int, layout: str) -> None:
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [shard_sequence(x, cp, rank, layout=layout) for rank in range(cp)]
    assert torch.equal(unshard_sequence(shards, layout=layout), x)
    assert sorted(torch.cat([local_positions(24, cp, r, layout) for r in range(cp)]).tolist()) == list(range(24))


def _causal_pairs(cp: int, rank: int, layout: str) -> int:
    """(query, key) pairs a rank computes under a causal mask, summed over every key chunk of the sequence."""
    everything = [chunk for r in range(cp) for chunk in chunk_ranges(8 * cp, cp, r, layout)]
    weight = {"skip": 0, "full": 2, "diagonal": 1}  # a diagonal pair is half a full one
    return sum(weight[pair_kind(q, k, causal=True)] for q in chunk_ranges(8 * cp, cp, rank, layout) for k in everything)


def test_zigzag_balances_causal_work_and_contiguous_does_not() -> None:
    assert len({_causal_pairs(4, rank, "zigzag") for rank in range(4)}) == 1
    contiguous = [_causal_pairs(4, rank, "contiguous") for rank in range(4)]
    assert contiguous == sorted(contiguous) and contiguous[-1] > 3 * contiguous[0]


def test_length_not_divisible_by_2cp_is_refused_naming_length_and_cp() -> None:
    with pytest.raises(ConfigurationError, match=r"Sequence length 30 .* 2 \* cp = 8 \(cp=4\)"):
        check_sequence_length(30, 4)
    with pytest.raises(ConfigurationError, match="Sequence length 6"):
        shard_sequence(torch.zeros(1, 6), 2, 0)


def _qkv(heads: int = 4, kv_heads: int = 4, seq: int = 8) -> tuple[torch.Tensor, ...]:
    return torch.zeros(1, heads, seq, 8), torch.zeros(1, kv_heads, seq, 8), torch.zeros(1, kv_heads, seq, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mode="ulysses", cp=8), r"query heads \(4\) .* must divide by 8"),
        (dict(mode="ring", cp=2, kv_heads=2), "pass enable_gqa=True"),
        (dict(mode="ring", cp=2, seq=3), "Sequence length 6 is not divisible"),
        (dict(mode="tree", cp=2), "Unknown context-parallel attention mode 'tree'"),
    ],
)
def test_refusals_name_the_bad_value(kwargs: dict, message: str) -> None:
    mode, cp = kwargs.pop("mode"), kwargs.pop("cp")
    with pytest.raises(ConfigurationError, match=message):
        _check(*_qkv(**kwargs), cp=cp, mode=mode, enable_gqa=False)


def test_mask_and_dropout_are_refused_under_the_mode() -> None:
    q, k, v = _qkv()
    # Refused before any communication, so no process group is needed.
    with ContextParallelAttention() as attention, pytest.raises(ConfigurationError, match=r"attn_mask .* \(8, 8\)"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with ContextParallelAttention(), pytest.raises(ConfigurationError, match=r"dropout_p=0\.1"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert attention.calls == 1
    with pytest.raises(ConfigurationError, match="Unknown context-parallel layout 'striped'"):
        ContextParallelAttention(layout="striped")  # type: ignore[arg-type]
