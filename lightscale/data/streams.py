"""Streaming datasets that split themselves by rank, pointed at this process's data shard instead.

litdata's ``StreamingDataset`` and Hugging Face ``datasets.distributed.split_dataset_by_node`` divide a stream by
the global rank and world size; under tensor, context or pipeline parallelism the ranks that share a batch would then
read different samples (lightscale stops such a run at its first step). These two calls give them the data shard
(:func:`lightscale.data_shard`: ``dp x ep`` shards) instead. Call them where the strategy has already set up (in a
DataModule's ``setup`` or ``train_dataloader``), as litdata and ``split_dataset_by_node`` read the layout once.

Resuming mid-epoch: wrap the stream in litdata's ``StreamingDataLoader`` or torchdata's ``StatefulDataLoader``;
Lightning saves their position and lightscale gives every data shard its own back (data/loader_position.py).

Example:
    >>> def train_dataloader(self):
    ...     stream = lightscale.streams.shard_litdata(litdata.StreamingDataset("data/train", shuffle=True))
    ...     return litdata.StreamingDataLoader(stream, batch_size=8)
"""

from __future__ import annotations

from typing import Any

from lightscale.data.data_shard import data_shard
from lightscale.errors import import_extra
from lightscale.patches.litdata import set_stream_environment


def shard_litdata(dataset: Any) -> Any:
    """litdata's ``StreamingDataset`` (or ``CombinedStreamingDataset``) reading this process's data shard.

    litdata takes its split from ``dataset.distributed_env`` (world size, global rank, nodes), which it detects from
    torch.distributed when the dataset is built; this replaces it with the data shard, one node per shard count.
    """
    import_extra("litdata.utilities.env", "litdata")  # the extra named before anything is set
    shard = data_shard()
    set_stream_environment(dataset, world_size=shard.count, global_rank=shard.index, num_nodes=1)
    return dataset


def shard_hf(dataset: Any) -> Any:
    """A Hugging Face ``datasets`` (Iterable)Dataset split for this process's data shard by ``split_dataset_by_node``.

    An ``IterableDataset`` with ``n_shards`` divisible by the shard count reads whole files per data shard; otherwise
    every data shard reads the stream and keeps every ``count``-th sample.
    """
    distributed = import_extra("datasets.distributed", "data")
    index, count = data_shard()
    return distributed.split_dataset_by_node(dataset, rank=index, world_size=count)
