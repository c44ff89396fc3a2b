"""Every sample exactly once per epoch per data-parallel group, for the user's own DataLoader.

Lightning injects a ``DistributedSampler`` into a plain DataLoader; with ``drop_last=False`` it pads the last batch
with repeated samples, with ``drop_last=True`` it drops them, silently either way. lightscale strategies put an
:class:`ExactlyOnceSampler` in its place (same shuffle, seed and ``set_epoch``): full global batches first, each
rank taking slice ``[r*b, (r+1)*b)`` of every global batch of ``b*R`` samples (so losses match one process with
batch ``b*R``), then the ``rem`` samples left over split over the ranks in one last, shorter step (sizes differ by at
most one; every rank runs the same number of steps, so collectives never wait for a missing rank).

Loss weighting of that last step: each rank averages its own samples and the ranks' gradients are averaged, so a
sample on a rank holding ``k`` of them weighs ``1 / (R * k)``, not ``1 / rem``; ``k`` differs by at most one.

Where a short last batch cannot run - ``DataLoader(drop_last=True)``, or training under a pipeline (one batch shape)
- the remainder is dropped every epoch with a warning naming how many samples. ``0 < rem < R`` without
``drop_last`` is refused: some rank would have an empty last batch.

Worker seeds: under ``seed_everything(workers=True)`` (what ``LightningCLI`` and so ``lightscale fit`` call) Lightning
seeds each DataLoader worker by the global rank, so the tensor-, context- and pipeline-parallel ranks of one data
shard would draw different random augmentations; :func:`seed_workers_by_data_shard` seeds them by the data shard.

Example:
    >>> list(ExactlyOnceSampler(range(7), batch_size=2, num_replicas=2, rank=1, shuffle=False))
    [2, 3, 6]
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sized
from functools import partial
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightscale.errors import ConfigurationError


class ExactlyOnceSampler(DistributedSampler):
    """Data-parallel sharding of ``range(len(dataset))`` with nothing repeated and nothing silently dropped.

    ``skip_batches`` (set by :meth:`resume_from`) skips this rank's first batches of one epoch: a run resumed
    mid-epoch trains on the rest of that epoch only. ``len()`` stays the whole epoch's length, so Lightning's batch
    counters (which continue from the checkpoint) end the epoch where an uninterrupted run would.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_remainder: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.num_items = len(dataset)
        global_batch = batch_size * num_replicas
        self.full_batches, self.remainder = divmod(self.num_items, global_batch)
        self.drop_remainder = drop_remainder or self.remainder == 0
        if not self.drop_remainder and self.remainder < num_replicas:
            raise ConfigurationError(
                f"A dataset of {self.num_items} samples leaves {self.remainder} after the full global batches of "
                f"{global_batch} (batch_size={batch_size} x {num_replicas} data-parallel ranks): fewer than one per "
                f"rank, so a rank would have an empty last batch. Valid: a remainder of 0 or >= {num_replicas}; or "
                f"DataLoader(drop_last=True) to drop those {self.remainder} samples every epoch (lightscale warns)."
            )
        self.skip_epoch, self.skip_batches = -1, 0

    def resume_from(self, epoch: int, batches_done: int) -> None:
        """Skip the ``batches_done`` local batches of ``epoch`` already trained on (resuming mid-epoch)."""
        self.skip_epoch, self.skip_batches = epoch, batches_done

    @property
    def dropped(self) -> int:
        """Samples dropped every epoch (the remainder, where a short last batch cannot run)."""
        return self.remainder if self.drop_remainder else 0

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_items)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)  # DistributedSampler's permutation
        return torch.randperm(self.num_items, generator=generator).numpy()

    def local_indices(self) -> np.ndarray:
        """This rank's sample indices for the current epoch, resumed batches included."""
        order = self._order()
        b, global_batch = self.batch_size, self.batch_size * self.num_replicas
        full = order[: self.full_batches * global_batch].reshape(self.full_batches, self.num_replicas, b)
        mine = [full[:, self.rank].reshape(-1)]
        if not self.drop_remainder:
            mine.append(np.array_split(order[self.full_batches * global_batch :], self.num_replicas)[self.rank])
        return np.concatenate(mine)

    @override
    def __iter__(self) -> Iterator[int]:
        skip = self.skip_batches * self.batch_size if self.epoch == self.skip_epoch else 0
        return iter(self.local_indices()[skip:].tolist())

    @override
    def __len__(self) -> int:
        share = (
            0 if self.drop_remainder else len(np.array_split(np.arange(self.remainder), self.num_replicas)[self.rank])
        )
        return self.full_batches * self.batch_size + share


def exactly_once_loader(
    dataloader: object, *, num_replicas: int, rank: int, training: bool, drop_remainder: bool, position: tuple[int, int]
) -> object:
    """``dataloader`` with Lightning's injected ``DistributedSampler`` replaced by an :class:`ExactlyOnceSampler`.

    Loaders with another sampler (the user's own, or an iterable dataset) and custom batch samplers are returned
    unchanged. ``position`` is the (epoch, batches done) a resumed fit continues from.
    """
    if not _is_plain_distributed(dataloader, num_replicas, rank):
        return dataloader

    assert isinstance(dataloader, DataLoader) and isinstance(dataloader.sampler, DistributedSampler)
    old = dataloader.sampler
    sampler = ExactlyOnceSampler(
        dataloader.dataset,  # type: ignore[arg-type]
        batch_size=dataloader.batch_size,  # type: ignore[arg-type]
        num_replicas=num_replicas,
        rank=rank,
        shuffle=old.shuffle,
        seed=old.seed,
        drop_remainder=drop_remainder or dataloader.drop_last,
    )
    if training:
        sampler.resume_from(*position)
    if sampler.dropped:
        why = "drop_last=True" if dataloader.drop_last else "training under a pipeline runs one batch shape"
        rank_zero_warn(
            f"{sampler.dropped} of {sampler.num_items} samples are dropped every epoch ({why}): they do not fill a "
            f"global batch of {dataloader.batch_size} x {num_replicas}. A dataset size divisible by "
            f"{dataloader.batch_size * num_replicas} trains on every sample."
        )
    stage = RunningStage.TRAINING if training else RunningStage.VALIDATING
    return _update_dataloader(dataloader, sampler, mode=stage)


def _is_plain_distributed(dataloader: object, num_replicas: int, rank: int) -> bool:
    # Exactly torch's DistributedSampler (Lightning's injection, or the user's with the same layout) without
    # drop_last; subclasses and wrappers of other samplers are the user's choice and stay.
    if not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
        return False
    sampler: Any = dataloader.sampler
    return (
        type(sampler) is DistributedSampler
        and not sampler.drop_last
        and (sampler.num_replicas, sampler.rank) == (num_replicas, rank)
    )


def position_in_epoch(trainer: Any) -> tuple[int, int]:
    """(epoch, batches done) restored from a checkpoint, so a mid-epoch resume sees no batch twice.

    ``ready`` counts batches fetched: a checkpoint written in ``on_train_batch_end`` (ModelCheckpoint) has not
    marked its batch "completed" yet, but that batch was trained on. Outside a resumed fit: ``(-1, 0)``.
    """
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is None or not fit_loop.restarting:
        return -1, 0
    return fit_loop.epoch_progress.current.completed, fit_loop.epoch_loop.batch_progress.current.ready


def seed_workers_by_data_shard(dataloader: object, shard_index: int) -> None:
    """Under ``seed_everything(workers=True)``, seed ``dataloader``'s workers by its data shard: Lightning's seeding
    (which comes after and keeps a ``worker_init_fn`` already set) would use the global rank. A user's own
    ``worker_init_fn`` stays."""
    seeds_workers = bool(int(os.environ.get("PL_SEED_WORKERS", 0)))
    if seeds_workers and isinstance(dataloader, DataLoader) and dataloader.worker_init_fn is None:
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=shard_index)
