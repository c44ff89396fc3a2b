"""Which tokens of a sequence each context-parallel rank holds: zigzag (load-balanced) or contiguous.

The sequence is cut into ``2 * cp`` equal chunks. Under ``"zigzag"`` rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (a head and a tail), so under a causal mask every rank has the same number of (query, key)
pairs to compute; under ``"contiguous"`` rank ``r`` holds chunks ``2r`` and ``2r + 1`` (rank 0 sees almost nothing,
the last rank almost everything: kept as the naive baseline the benchmark compares against).

Example:
    >>> chunk_ranges(8, cp=2, rank=0)
    [(0, 2), (6, 8)]
    >>> local_positions(8, cp=2, rank=0)
    tensor([0, 1, 6, 7])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from lightscale.errors import ConfigurationError

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Refuse a length the layout cannot cut into ``2 * cp`` equal chunks, naming the length and cp."""
    if cp < 1:
        raise ConfigurationError(f"Context parallel degree cp={cp} must be at least 1.")
    if seq_len % (2 * cp) != 0:
        padded = -(-seq_len // (2 * cp)) * (2 * cp)
        problem = "is shorter than" if seq_len < 2 * cp else "is not divisible by"
        raise ConfigurationError(
            f"Sequence length {seq_len} {problem} 2 * cp = {2 * cp} (cp={cp}): context parallelism cuts the "
            f"sequence into 2 * cp equal chunks. Pad or crop the sequence to a multiple of {2 * cp} (e.g. {padded})."
        )


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigurationError(f"Unknown context-parallel layout {layout!r}; valid: {list(LAYOUTS)}.")


def chunk_ids(cp: int, rank: int, layout: Layout = "zigzag") -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) that ``rank`` holds, in the order they sit in its local tensor."""
    _check_layout(layout)
    if not 0 <= rank < cp:
        raise ConfigurationError(f"Rank {rank} is outside the context-parallel group of size cp={cp}.")
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def chunk_ranges(seq_len: int, cp: int, rank: int, layout: Layout = "zigzag") -> list[tuple[int, int]]:
    """Global ``[start, end)`` of each chunk ``rank`` holds, in local order."""
    check_sequence_length(seq_len, cp)
    size = seq_len // (2 * cp)
    return [(c * size, (c + 1) * size) for c in chunk_ids(cp, rank, layout)]


def local_positions(seq_len: int, cp: int, rank: int, layout: Layout = "zigzag") -> Tensor:
    """Global position of each local token: what learned position embeddings and RoPE must be fed."""
    return torch.cat([torch.arange(start, end) for start, end in chunk_ranges(seq_len, cp, rank, layout)])


def shard_sequence(x: Tensor, cp: int, rank: int, *, dim: int = 1, layout: Layout = "zigzag") -> Tensor:
    """This rank's tokens of a full-length tensor (inputs, labels already shifted, masks), along ``dim``."""
    index = local_positions(x.shape[dim], cp, rank, layout).to(x.device)
    return x.index_select(dim, index)


def unshard_sequence(shards: list[Tensor], *, dim: int = 1, layout: Layout = "zigzag") -> Tensor:
    """The full-length tensor from every rank's shard (in rank order): undoes :func:`shard_sequence`."""
    cp = len(shards)
    seq_len = sum(shard.shape[dim] for shard in shards)
    order = torch.cat([local_positions(seq_len, cp, rank, layout) for rank in range(cp)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return torch.cat(shards, dim=dim).index_select(dim, inverse.to(shards[0].device))


def shard_batch(batch: Any, dims: Any, cp: int, rank: int, *, layout: Layout = "zigzag") -> Any:
    """This rank's tokens of every tensor of ``batch`` along its sequence dimension in ``dims`` (a structure like
    ``batch``: an int per tensor, ``None`` to keep the tensor whole); other entries pass unchanged.

    Example:
        >>> tokens, targets = shard_batch((tokens, targets), (1, 1), cp=2, rank=0)
    """
    if isinstance(batch, Tensor):
        return batch if dims is None else shard_sequence(batch, cp, rank, dim=dims, layout=layout)
    if isinstance(batch, Mapping):
        shards = {key: shard_batch(value, dims.get(key), cp, rank, layout=layout) for key, value in batch.items()}
        return type(batch)(shards)
    if isinstance(batch, (list, tuple)):
        sharded = [shard_batch(value, dim, cp, rank, layout=layout) for value, dim in zip(batch, dims, strict=True)]
        return type(batch)(*sharded) if hasattr(batch, "_fields") else type(batch)(sharded)
    return batch
