"""Ranks of one data shard must train on the same batch: checked at the first training step and every ``N`` after.

Tensor-parallel ranks push one batch through split layers, context-parallel ranks cut its sequences, pipeline stages
pass it along (inputs on the first, targets on the last): given *different* batches they train on garbage with a
falling loss and no error - what a dataset that shards itself by ``torch.distributed.get_rank()`` does. So every
rank reduces its batch to a few float64 sums (:func:`batch_checksum`), one all-gather over the world gives every
rank every rank's sums, and every rank compares them within each data shard's tp / cp / pp groups
(:func:`disagreements`) the same way: on a mismatch every rank raises the same error at the same point, so none is
left waiting in a collective. The world (not each shard's group) is gathered for that reason; it is a few numbers
per rank, and only every ``N`` steps.

Example:
    >>> agreement = BatchAgreement(dims, every=100)
    >>> agreement.maybe_check(batch, device=torch.device("cuda", 0))  # in every rank, before each training step
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightscale.errors import ConfigurationError
from lightscale.parallel.mesh import AXIS_ORDER, ParallelDims
from lightscale.runtime.collectives import all_gather_single

# The axes whose ranks share one data shard, innermost first (the order a mismatch is reported in).
SHARED_AXES = {"tp": "tensor-parallel", "cp": "context-parallel", "pp": "pipeline-parallel"}
DEFAULT_EVERY = 100
_SUMS = 4  # tensors, elements, sum of values, position-weighted sum of values


def check_every(every: Any) -> None:
    """Refuse an interval that is neither a positive number of training steps nor ``None`` (off)."""
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigurationError(
            f"check_batches_every={every!r} is not valid: use a positive number of training steps (the batches of "
            f"ranks that share a data shard are compared at the first step and every that many; default "
            f"{DEFAULT_EVERY}), or None to turn the check off."
        )


class BatchAgreement:
    """Compares the batches of ranks that share a data shard at training steps ``0, every, 2 * every, ...``."""

    def __init__(self, dims: ParallelDims, *, every: int | None) -> None:
        check_every(every)
        self.dims = dims
        self.every = every
        self.steps = 0

    @property
    def needed(self) -> bool:
        """Whether some ranks share a data shard (tp, cp or pp > 1) and the check is on."""
        return self.every is not None and self.dims.data_shards < self.dims.world_size

    def maybe_check(self, batch: Any, *, device: torch.device) -> None:
        """Collective on a checked step (every rank calls it before every training step)."""
        step, self.steps = self.steps, self.steps + 1
        if not self.needed or step % self.every:  # type: ignore[operator]
            return
        local = batch_checksum(batch, device=device)
        gathered = torch.empty(self.dims.world_size * _SUMS, dtype=local.dtype, device=device)
        all_gather_single(gathered, local)
        check_agreement(gathered.view(self.dims.world_size, _SUMS).cpu(), self.dims, step=step)


def batch_checksum(batch: Any, *, device: torch.device | None = None) -> Tensor:
    """Four float64 sums over every tensor of ``batch`` (nested in dicts, lists, tuples), on ``device``: tensors,
    elements, values, and values weighted by position and tensor index (a reordered batch differs). A sum that is
    NaN becomes 0, so equal batches holding a NaN still agree."""
    sums = torch.zeros(_SUMS, dtype=torch.float64, device=device)
    for index, tensor in enumerate(_tensors(batch)):
        flat = tensor.detach().reshape(-1).to(device=device, dtype=torch.float64)
        positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device)
        sums += torch.stack(
            [flat.new_tensor(1.0), flat.new_tensor(flat.numel()), flat.sum(), (flat * positions).sum() * (index + 1)]
        )
    return sums.nan_to_num(0.0)


def _tensors(batch: Any) -> Iterator[Tensor]:
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def disagreements(checksums: Tensor, dims: ParallelDims) -> list[tuple[str, list[int]]]:
    """``(axis, ranks)`` for the first group of each shared axis whose ranks' ``checksums`` (one row per global
    rank) differ; empty when every group agrees. Rows are compared to a relative 1e-9: equal batches give equal
    sums, different ones differ by far more."""
    shape = [getattr(dims, axis) for axis in AXIS_ORDER]
    ranks = torch.arange(dims.world_size).reshape(shape)
    found = []
    for axis, size in ((axis, getattr(dims, axis)) for axis in SHARED_AXES):
        if size == 1:
            continue
        for group in ranks.movedim(AXIS_ORDER.index(axis), -1).reshape(-1, size).tolist():
            rows = checksums[group]
            if not torch.allclose(rows, rows[:1].expand_as(rows), rtol=1e-9, atol=0.0):
                found.append((axis, group))
                break
    return found


def check_agreement(checksums: Tensor, dims: ParallelDims, *, step: int) -> None:
    """Raise, naming the ranks, their group and the fix, when ranks of one data shard had different batches."""
    found = disagreements(checksums, dims)
    if not found:
        return
    groups = "; ".join(
        f"ranks {group} of a {SHARED_AXES[axis]} group ({axis}), data shard {dims.data_rank(group[0])}"
        for axis, group in found
    )
    raise ConfigurationError(
        f"Ranks that share a data shard were given different batches at training step {step}: {groups}. Tensor-, "
        f"context- and pipeline-parallel ranks must read the same samples; only data- and expert-parallel ranks read "
        f"their own (here dp x ep = {dims.data_shards} data shard{'s' if dims.data_shards > 1 else ''} on "
        f"{dims.world_size} ranks). A dataset that "
        f"shards itself by torch.distributed.get_rank() / get_world_size() (litdata, webdataset, "
        f"split_dataset_by_node, most hand-written streams) does this: shard by `index, count = "
        f"lightscale.data_shard()` instead, and seed any random augmentation by that index, not the rank "
        f"(docs/data.md). Checked at the first step and every check_batches_every steps."
    )
