"""Which data shard this process reads: the one call a dataset makes instead of asking for the global rank.

Ranks that split one batch between them - tensor-parallel ranks (the same tokens through split layers),
context-parallel ranks (one sequence cut along its length), pipeline stages (one batch passing through) - must read
the *same* samples; only data-parallel and expert-parallel ranks read their own. A dataset that shards itself by
``torch.distributed.get_rank()`` (litdata, webdataset, ``datasets.distributed.split_dataset_by_node`` and most
hand-written streams do) gives those ranks different batches, which trains on garbage without an error. So the
number of data shards is ``dp x ep`` and :func:`data_shard` says which one this process reads.

Every lightscale strategy publishes its shard in this process's environment when it sets up its layout (before any
DataLoader exists), so DataLoader worker processes - forked or spawned, with no process group of their own -
inherit it. Without a lightscale strategy the answer is the process group's ``(rank, world_size)``, or ``(0, 1)``.

Example:
    >>> class Stream(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         shard = lightscale.data_shard()  # in __iter__: it runs in the rank (or its worker) that reads
    ...         yield from self.samples[shard.index :: shard.count]
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch.distributed as dist

from lightscale.errors import ConfigurationError

# Set by a lightscale strategy in each rank; DataLoader workers inherit them.
INDEX_VARIABLE = "LIGHTSCALE_DATA_SHARD_INDEX"
COUNT_VARIABLE = "LIGHTSCALE_DATA_SHARD_COUNT"


class DataShard(NamedTuple):
    """This process's data shard: ``index`` in ``range(count)``; ``count`` = data-parallel x expert-parallel ranks."""

    index: int
    count: int


def data_shard() -> DataShard:
    """The data shard this process (a rank, or a DataLoader worker of one) reads; see the module docstring.

    Example:
        >>> index, count = lightscale.data_shard()
        >>> mine = samples[index::count]
    """
    index, count = os.environ.get(INDEX_VARIABLE), os.environ.get(COUNT_VARIABLE)
    if index is not None and count is not None:
        return _parsed(index, count)
    if dist.is_available() and dist.is_initialized():
        return DataShard(dist.get_rank(), dist.get_world_size())
    return DataShard(0, 1)


def publish_data_shard(shard: DataShard) -> None:
    """Make ``shard`` this process's answer to :func:`data_shard`, and that of every process it starts from now on."""
    if not 0 <= shard.index < shard.count:
        raise ConfigurationError(f"Data shard index {shard.index} is not in range({shard.count}).")
    os.environ[INDEX_VARIABLE], os.environ[COUNT_VARIABLE] = str(shard.index), str(shard.count)


def _parsed(index: str, count: str) -> DataShard:
    try:
        shard = DataShard(int(index), int(count))
    except ValueError:
        shard = DataShard(-1, 0)
    if not 0 <= shard.index < shard.count:
        raise ConfigurationError(
            f"{INDEX_VARIABLE}={index!r} and {COUNT_VARIABLE}={count!r} are not a data shard: lightscale's strategies "
            f"set them to integers with 0 <= index < count; unset both to use the process group's rank."
        )
    return shard
