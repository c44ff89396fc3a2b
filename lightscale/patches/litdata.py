"""litdata names lightscale sets: the distributed environment a streaming dataset splits itself by.

Example:
    >>> set_stream_environment(stream, world_size=4, global_rank=1, num_nodes=4)
"""

from __future__ import annotations

from typing import Any

from lightscale.patches.table import Patch

PATCHES = [
    Patch(
        "StreamingDataset.distributed_env",
        "instance",
        "litdata splits a stream by the global rank it detects when the dataset is built; under tp/cp/pp the ranks "
        "sharing a batch must read the same samples, so the stream gets the data shard instead",
        "a StreamingDataset argument for the replica count and index (as DistributedSampler has)",
        signature=(
            "litdata.utilities.env:_DistributedEnv.__init__",
            ("self", "world_size", "global_rank", "num_nodes"),
        ),
        attributes=("litdata.streaming.dataset:StreamingDataset", ("distributed_env",)),
    ),
    Patch(
        "CombinedStreamingDataset._datasets",
        "instance",
        "a combined stream splits each of its streams by its own distributed_env: each one gets the data shard",
        "the same StreamingDataset argument, passed through by CombinedStreamingDataset",
        attributes=("litdata.streaming.combined:CombinedStreamingDataset", ("_datasets",)),
    ),
]


def set_stream_environment(dataset: Any, *, world_size: int, global_rank: int, num_nodes: int) -> None:
    """Every stream of ``dataset`` (one, or a combined one's) splits itself as this environment says."""
    from litdata.utilities.env import _DistributedEnv

    env = _DistributedEnv(world_size=world_size, global_rank=global_rank, num_nodes=num_nodes)
    for stream in getattr(dataset, "_datasets", [dataset]):
        stream.distributed_env = env
