"""Is a checkpoint directory shared by every node? Asked once per directory, before anything is written to it.

lightscale's checkpoints are written by ranks on every node (DCP shards of every strategy, or DeepSpeed's
partitions with ``checkpoint_format="deepspeed"``) and published by global rank 0 (the staging rename,
``trainer_state.pt``). On a directory each node has its own
copy of (a node-local disk under the same path), node 1's shards would sit where no loader finds them and node
1's resume would find no checkpoint at all, or an older one. Nothing in Lightning notices.

The probe: each node's local rank 0 writes ``.lightscale_node<N>.<token>`` into the directory; after a barrier every
rank looks for every node's marker (retrying for ``wait_s``, since network filesystems may show a new file to other
nodes a little later); the answers are gathered and the markers removed. Every rank seeing every marker means
shared; anything else is refused, naming which node sees which markers and the fix.

Example:
    >>> check_shared_dir(Path("ckpts"), node_rank=0, local_rank=0, num_nodes=2)  # collective, on every rank
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch.distributed as dist

from lightscale.errors import ConfigurationError
from lightscale.runtime.barrier import barrier

DEFAULT_WAIT_S = 5.0


def _marker(directory: Path, node: int, token: str) -> Path:
    return directory / f".lightscale_node{node}.{token}"


def nodes_seen(directory: Path, *, node_rank: int, local_rank: int, num_nodes: int, wait_s: float) -> list[int]:
    """Collective: write this node's marker (local rank 0), return the nodes whose markers this rank sees."""
    holder = [uuid.uuid4().hex if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(holder, src=0)
    token = holder[0]
    if local_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        _marker(directory, node_rank, token).touch()
    barrier()
    deadline = time.monotonic() + wait_s
    while True:
        seen = [node for node in range(num_nodes) if _marker(directory, node, token).exists()]
        if len(seen) == num_nodes or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    barrier()
    if local_rank == 0:
        _marker(directory, node_rank, token).unlink(missing_ok=True)
    return seen


def check_shared_dir(
    directory: Path, *, node_rank: int, local_rank: int, num_nodes: int, wait_s: float = DEFAULT_WAIT_S
) -> None:
    """Refuse (on every rank) a checkpoint ``directory`` that not every node sees as the same directory."""
    if num_nodes <= 1 or not dist.is_initialized():
        return
    seen = nodes_seen(directory, node_rank=node_rank, local_rank=local_rank, num_nodes=num_nodes, wait_s=wait_s)
    per_rank: list[tuple[int, list[int]]] = [(0, [])] * dist.get_world_size()
    dist.all_gather_object(per_rank, (node_rank, seen))
    by_node = {node: nodes for node, nodes in sorted(per_rank)}
    if all(len(nodes) == num_nodes for _, nodes in per_rank):
        return
    views = "; ".join(f"node {node} sees the markers of nodes {nodes}" for node, nodes in by_node.items())
    raise ConfigurationError(
        f"Checkpoint directory {str(directory)!r} is not shared by all {num_nodes} nodes ({views}): checkpoints "
        "are written by ranks on every node and published by global rank 0, so a node-local directory would "
        "leave shards and the published checkpoint on different machines. Use a directory on a filesystem every "
        "node mounts (NFS, Lustre, GPFS, ...) as ModelCheckpoint(dirpath=...) / the save path."
    )
