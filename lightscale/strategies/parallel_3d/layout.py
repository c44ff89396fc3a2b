"""How ``parallel_3d``'s degrees lay out the ranks (``ParallelDims``) and what one rank then holds (the estimator's
``Layout``), from the settings alone: the class answers ``lightscale plan`` without an instance.

Example:
    >>> dims_of(8, -1, "shard", tp=2, pp=2, ep=1, cp=1).dp_shard
    2
"""

from __future__ import annotations

from typing import Any

from lightscale.estimate.memory_layout import Layout
from lightscale.parallel.mesh import ParallelDims
from lightscale.parallel.pipeline import default_stages_per_rank

# What the layout reads of an instance: its init parameters of the same names (microbatches, stages_per_rank resolved).
LAYOUT_SETTINGS = (
    "dp",
    "dp_mode",
    "tp",
    "pp",
    "ep",
    "cp",
    "cp_mode",
    "schedule",
    "microbatches",
    "stages_per_rank",
    "activation_checkpointing",
    "sequence_parallel",
    "loss_parallel",
)


def dims_of(world_size: int, dp: int, dp_mode: str, *, tp: int, pp: int, ep: int, cp: int) -> ParallelDims:
    """The layout: ``dp`` ranks shard (``dp_mode="shard"``) or replicate the dense part, times tp, pp, ep, cp."""
    shard = dp_mode == "shard"
    return ParallelDims(
        world_size=world_size,
        dp_shard=dp if shard else 1,
        dp_replicate=1 if shard else dp,
        tp=tp,
        pp=pp,
        ep=ep,
        cp=cp,
    )


def parallel_3d_layout(name: str, world_size: int, p: dict[str, Any]) -> Layout:
    """Dense states sharded by FSDP2 over dp_shard x ep x cp, layers split over tp, stages over pp, sequences over cp
    (activations); ``p``: the strategy's settings by their init names (``LAYOUT_SETTINGS``)."""
    dims = dims_of(world_size, p["dp"], p["dp_mode"], tp=p["tp"], pp=p["pp"], ep=p["ep"], cp=p["cp"])
    dense_shard = dims.dp_shard * dims.ep * dims.cp  # FSDP2 shards the dense part over the ep and cp ranks too
    sharded = dense_shard > 1
    stages_per_rank = p["stages_per_rank"]
    stages_per_rank = default_stages_per_rank(p["schedule"]) if stages_per_rank is None else stages_per_rank
    return Layout(
        name,
        world_size,
        shard_optimizer=sharded,
        shard_gradients=sharded,
        shard_parameters=sharded,
        dp_shard=dense_shard,
        dp_replicate=dims.dp_replicate,
        tp=dims.tp,
        pp=dims.pp,
        ep=dims.ep,
        cp=dims.cp,
        cp_mode=p["cp_mode"],
        stages_per_rank=stages_per_rank if dims.pp > 1 else 1,
        microbatches=p["pp"] if p["microbatches"] is None else p["microbatches"],
        v_shape=p["schedule"] == "zbv",
        activation_checkpointing=p["activation_checkpointing"],
        sequence_parallel=p["sequence_parallel"] and dims.tp > 1,
        loss_parallel=p["loss_parallel"] and dims.tp > 1,
    )
