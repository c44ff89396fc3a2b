"""Where a resumed stream starts: the position a training loader saves, and every data shard's in the checkpoint.

The batches trained, not Lightning's look-ahead: Lightning saves the ``state_dict()`` of stateful loaders (torchdata's
``StatefulDataLoader``, litdata's ``StreamingDataLoader``) in its checkpoints. A loader without ``len`` (a stream) it
reads one batch ahead (``_PrefetchDataFetcher``, to know which batch is the last), so a checkpoint written after batch
``n`` holds the position after batch ``n + 1``: resumed, that batch is never trained. lightscale strategies wrap such
a loader in :class:`TrainedPosition`, whose ``state_dict()`` is the state taken right after batch ``n`` was handed out
(the one before the newest, or the newest once the loader ran out, when nothing was read ahead). Sized loaders are not
read ahead and stay as they are.

Every data shard's own position: Lightning keeps the loaders' states in its fit loop's state, but only rank 0 writes
``trainer_state.pt``: every rank would resume from rank 0's position, and a rank reading another data shard would
repeat or skip its own samples. So each rank's loader state is gathered with its data shard
(:func:`lightscale.data_shard`) and, at load, every rank takes back the state saved for the shard it now reads: the
same number of data shards resumes exactly (whatever the tp / cp / pp around them). With another number of shards
there is no shard-to-shard mapping: rank 0's state stays (litdata re-splits its position itself; other loaders do
not), with a warning.

Example:
    >>> loader = maybe_track_trained_position(StatefulDataLoader(hf_stream, batch_size=8), training=True)
    >>> trainer_state["lightscale"]["loaders"] = gather_loader_states(checkpoint)  # collective
    >>> take_own_loader_state(trainer_state)  # each rank, after reading trainer_state.pt
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightscale.data.data_shard import DataShard, data_shard
from lightscale.errors import ConfigurationError

_OWN = ("loader", "_states", "_exhausted")


class TrainedPosition:
    """Iterates ``loader``; ``state_dict()`` is its state after the batch before the newest one handed out."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._states: deque[dict[str, Any]] = deque(maxlen=2)
        self._exhausted = False

    def __iter__(self) -> Iterator[Any]:
        self._states.clear()
        self._states.append(self.loader.state_dict())  # before the first batch: nothing of this epoch trained
        self._exhausted = False
        for batch in self.loader:
            self._states.append(self.loader.state_dict())
            yield batch
        self._exhausted = True

    def state_dict(self) -> dict[str, Any]:
        if not self._states:
            return self.loader.state_dict()
        # Exhausted: Lightning's look-ahead found the end, so every batch handed out was trained.
        return self._states[-1] if self._exhausted or len(self._states) == 1 else self._states[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:  # batch_size, dataset, ... as the wrapped loader has them
        return getattr(self.__dict__["loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:  # e.g. Lightning's worker_init_fn: onto the loader
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)


def maybe_track_trained_position(dataloader: object, *, training: bool) -> object:
    """``dataloader`` wrapped in :class:`TrainedPosition` when it is a stateful training loader without ``len``."""
    if training and isinstance(dataloader, _Stateful) and sized_len(dataloader) is None:
        return TrainedPosition(dataloader)
    return dataloader


# ---- every data shard's position in the checkpoint ----


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
