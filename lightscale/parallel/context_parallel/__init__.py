"""Context parallelism: the sequence sharded over ranks, attention computed exactly across them (ring, allgather,
ulysses), routed from ``F.scaled_dot_product_attention`` by a torch function mode. docs/strategies/context_parallel.md
"""

from lightscale.parallel.context_parallel.attention import MODES, Mode, context_parallel_attention
from lightscale.parallel.context_parallel.dispatch import ContextParallelAttention, gather_sequence, positions
from lightscale.parallel.context_parallel.token_split import (
    LAYOUTS,
    Layout,
    check_sequence_length,
    chunk_ranges,
    local_positions,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "LAYOUTS",
    "MODES",
    "ContextParallelAttention",
    "Layout",
    "Mode",
    "check_sequence_length",
    "chunk_ranges",
    "context_parallel_attention",
    "gather_sequence",
    "local_positions",
    "positions",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
]
