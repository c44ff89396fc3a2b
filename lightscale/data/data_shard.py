"""Which data shard this process reads: the one call a dataset makes instead of asking for the global rank.

Ranks that split one batch between them - tensor-parallel ranks (the same tokens through split layers),
context-parallel ranks (one sequence cut along its length), pipeline stages (one batch passing through) - must read
the *same* samples; only data-parallel and expert-parallel ranks read their own. A dataset that shards itself by
``torch.distributed.get_rank()`` (litdata, webdataset, ``datasets.distributed.split_dataset_by_node`` and most
hand-written streams do) gives those ranks different batches, which trains on garbage without an error. So the
number of data shards is ``dp x ep`` and :func:`data_shard` says which one this process reads.

Every lightscale strategy publishes its shard in this process's environment when the Trainer is constructed and
again when ``fit`` sets up (before any DataLoader exists), so DataLoader worker processes - forked or spawned, with
no process group of their own - inherit it. Without a lightscale strategy the answer is the process group's
``(rank, world_size)``, or ``(0, 1)``. Code that holds the trainer (a callback, a DataModule) passes it and gets the
shard its strategy hands the sampler (``distributed_sampler_kwargs``): the same split, one function for both. The
process group of the ranks with different batches is parallel/mesh.py ``batch_mesh`` (its size is ``count``).

Example:
    >>> class Stream(torch.utils.data.IterableDataset):
    ...     def __iter__(self):
    ...         shard = lightscale.data_shard()  # in __iter__: it runs in the rank (or its worker) that reads
    ...         yield from self.samples[shard.index :: shard.count]
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch.distributed as dist

from lightscale.errors import ConfigurationError
from lightscale.patches.process import set_environment, unset_environment

# Set by a lightscale strategy in each rank; DataLoader workers inherit them. The publisher ("rank/world_size" of
# the process group it was published for) tells a shard inherited from another run's process apart.
INDEX_VARIABLE = "LIGHTSCALE_DATA_SHARD_INDEX"
COUNT_VARIABLE = "LIGHTSCALE_DATA_SHARD_COUNT"
PUBLISHER_VARIABLE = "LIGHTSCALE_DATA_SHARD_PUBLISHER"
VARIABLES = (INDEX_VARIABLE, COUNT_VARIABLE, PUBLISHER_VARIABLE)


class DataShard(NamedTuple):
    """This process's data shard: ``index`` in ``range(count)``; ``count`` = data-parallel x expert-parallel ranks."""

    index: int
    count: int


def data_shard(trainer: Any = None) -> DataShard:
    """The data shard this process (a rank, or a DataLoader worker of one) reads; see the module docstring.

    With ``trainer``: the shard its strategy gives the sampler, ``(0, 1)`` under a strategy that shards no data (one
    device: it has no ``distributed_sampler_kwargs``).

    Example:
        >>> index, count = lightscale.data_shard()
        >>> mine = samples[index::count]
        >>> lightscale.data_shard(trainer).count  # in a callback: the ranks with batches of their own
        4
    """
    if trainer is not None:
        return _sampler_shard(trainer.strategy)
    group = _process_group()
    index, count = os.environ.get(INDEX_VARIABLE), os.environ.get(COUNT_VARIABLE)
    if index is not None and count is not None and _published_for(group):
        return _parsed(index, count)
    return DataShard(*group) if group is not None else DataShard(0, 1)


def publish_data_shard(shard: DataShard, *, rank: int, world_size: int) -> None:
    """Make ``shard`` the answer to :func:`data_shard` of global ``rank`` of ``world_size``, in this process and every
    process it starts from now on."""
    if not 0 <= shard.index < shard.count:
        raise ConfigurationError(f"Data shard index {shard.index} is not in range({shard.count}).")
    set_environment(
        {INDEX_VARIABLE: str(shard.index), COUNT_VARIABLE: str(shard.count), PUBLISHER_VARIABLE: f"{rank}/{world_size}"}
    )


def forget_data_shard() -> None:
    """Drop a published shard (a run without a lightscale strategy: the process group's rank is the answer again)."""
    unset_environment(VARIABLES)


def _sampler_shard(strategy: Any) -> DataShard:
    # Lightning's parallel strategies (lightscale's among them) define it; single-device ones lack the attribute.
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
    return DataShard(kwargs["rank"], kwargs["num_replicas"]) if kwargs else DataShard(0, 1)


def _process_group() -> tuple[int, int] | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _published_for(group: tuple[int, int] | None) -> bool:
    """Whether the published shard is this process group's, not one inherited from a process that published for
    another (a launcher or test harness that forked this one after its own Trainer ran). Without a process group
    (a spawned DataLoader worker) it is."""
    publisher = os.environ.get(PUBLISHER_VARIABLE)
    return group is None or publisher is None or publisher == f"{group[0]}/{group[1]}"


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
