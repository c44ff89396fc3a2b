"""Every data shard's loader position in the checkpoint, so a resumed stream reads each sample once.

Lightning saves the ``state_dict()`` of stateful training loaders (torchdata's ``StatefulDataLoader``, litdata's
``StreamingDataLoader``) in its fit loop's state, but only rank 0 writes ``trainer_state.pt``: every rank would resume
from rank 0's position, and a rank reading another data shard would repeat or skip its own samples. So each rank's
loader state is gathered with its data shard (:func:`lightscale.data_shard`) and, at load, every rank takes back the
state saved for the shard it now reads: the same number of data shards resumes exactly (whatever the tp / cp / pp
around them). With another number of shards there is no shard-to-shard mapping: rank 0's state stays (litdata
re-splits its position itself; other loaders do not), with a warning.

Example:
    >>> trainer_state["lightscale"]["loaders"] = gather_loader_states(checkpoint)  # collective
    >>> take_own_loader_state(trainer_state)  # each rank, after reading trainer_state.pt
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightscale.data.data_shard import DataShard, data_shard
from lightscale.errors import ConfigurationError


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")


def gather_loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's ``{"shard": (index, count), "state": [loader states]}`` (collective); None without a stateful
    training loader (then every rank has none: the loaders are the same on all ranks)."""
    fit_state = _fit_loop_state(checkpoint)
    states = fit_state.get("combined_loader") if fit_state is not None else None
    mine = {"shard": tuple(data_shard()), "state": states} if states else None
    if not dist.is_initialized():
        return [mine] if mine is not None else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)  # every rank, with or without a state: none may skip the collective
    without = [rank for rank, entry in enumerate(gathered) if entry is None]
    if len(without) == len(gathered):
        return None
    if without:  # every rank sees the same list, so every rank raises here together
        raise ConfigurationError(
            f"Ranks {without} have no stateful training loader while the others do; the loader's position cannot be "
            "saved for every data shard. Build the same kind of training DataLoader on every rank."
        )
    return gathered


def take_own_loader_state(trainer_state: dict[str, Any]) -> None:
    """Put the loader state saved for this process's data shard where Lightning's fit loop restores it from."""
    saved = trainer_state.get("lightscale", {}).get("loaders")
    fit_state = _fit_loop_state(trainer_state)
    if not saved or fit_state is None:
        return
    shard = data_shard()
    by_shard = {DataShard(*entry["shard"]): entry["state"] for entry in saved}
    if shard in by_shard:
        fit_state["combined_loader"] = by_shard[shard]
        return
    counts = sorted({count for _, count in by_shard})
    rank_zero_warn(
        f"The checkpoint holds loader positions for {counts} data shards and this run reads {shard.count}: each rank "
        "resumes from rank 0's loader state (litdata re-splits it over the new shards; other stateful loaders may "
        "repeat or skip samples in this epoch)."
    )
