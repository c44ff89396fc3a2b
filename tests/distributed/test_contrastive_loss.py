"""The contrastive losses on their own: gradients of features and temperature equal one process, uneven batches
padded and masked, and each rank's logits are N_local x N_global."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightscale.parallel import contrastive
from lightscale.parallel.mesh import ParallelDims
from lightscale.testing import run_distributed

SIZES = (4, 3)  # rank 0 holds 4 pairs, rank 1 holds 3: an uneven last batch


def features(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, 8, generator=generator, dtype=torch.float64), dim=-1)
    text = F.normalize(torch.randn(n, 8, generator=generator, dtype=torch.float64), dim=-1)
    return image, text


def loss_and_grads(kind: str, image: torch.Tensor, text: torch.Tensor, group: Any, pad_to: int | None) -> list:
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = torch.tensor([10.0], dtype=torch.float64, requires_grad=True)
    bias = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    if kind == "clip":
        loss = contrastive.clip_loss(image, text, scale, group=group, pad_to=pad_to)
    else:
        loss = contrastive.siglip_loss(image, text, scale, bias, group=group, pad_to=pad_to)
    loss.backward()
    return [loss.detach(), image.grad, text.grad, scale.grad, bias.grad if kind == "siglip" else None]


def on_rank(kind: str) -> tuple[list, list[tuple[int, int]]]:
    rank = dist.get_rank()
    shapes: list[tuple[int, int]] = []
    cross_entropy = F.cross_entropy

    def spy(logits: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        shapes.append(tuple(logits.shape))
        return cross_entropy(logits, *args, **kwargs)

    contrastive.F.cross_entropy = spy  # this forked rank only
    image, text = features(rank, SIZES[rank])
    out = loss_and_grads(kind, image, text, dist.group.WORLD, pad_to=max(SIZES))
    # Gradients are averaged over ranks by every strategy: do it here as they would.
    for tensor in out[3:]:
        if tensor is not None:
            dist.all_reduce(tensor)
            tensor /= dist.get_world_size()
    loss = out[0].clone()
    dist.all_reduce(loss)
    return [loss / dist.get_world_size(), *out[1:]], shapes


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_uneven_batches_padded_and_masked_equal_one_process(kind: str) -> None:
    results = run_distributed(on_rank, kind, world_size=2)
    parts = [features(rank, n) for rank, n in enumerate(SIZES)]
    image, text = (torch.cat(tensors) for tensors in zip(*parts, strict=True))
    ref = loss_and_grads(kind, image, text, None, None)
    (loss, *_, scale_grad, bias_grad), _ = results[0]
    torch.testing.assert_close(loss, ref[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(scale_grad, ref[3], rtol=1e-12, atol=0)
    if kind == "siglip":
        torch.testing.assert_close(bias_grad, ref[4], rtol=1e-12, atol=0)
    # Each rank's feature gradients are its rows of the single-process gradients (the 1/W comes from averaging).
    offsets = [0, SIZES[0]]
    for rank, ((_, image_grad, text_grad, *_), _) in enumerate(results):
        rows = slice(offsets[rank], offsets[rank] + SIZES[rank])
        torch.testing.assert_close(image_grad / 2, ref[1][rows], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(text_grad / 2, ref[2][rows], rtol=1e-12, atol=1e-15)


def test_logits_are_local_rows_by_global_columns() -> None:
    results = run_distributed(on_rank, "clip", world_size=2)
    for rank, (_, shapes) in enumerate(results):
        assert shapes == [(SIZES[rank], 2 * max(SIZES))] * 2  # N_local x N_global (padded), never N_global^2


@dataclass(eq=False)
class Holder:
    """What the gather reads of a strategy: its degrees and mesh."""

    dims: ParallelDims
    device_mesh: Any


def gather_over_batch_group(kind: str) -> list:
    """dp_shard=2 x ep=2 on 4 ranks: every rank reads its own batch, so the gather must span all 4 (it spanned the 2
    dp ranks, leaving out the expert-parallel peers' negatives)."""
    dims = ParallelDims(world_size=4, dp_shard=2, ep=2)
    strategy = Holder(dims, dims.build_mesh("cpu"))
    image, text = features(dims.data_rank(dist.get_rank()), 3)
    out = loss_and_grads(kind, image, text, contrastive.data_parallel_group(strategy), pad_to=None)
    loss = out[0].clone()
    dist.all_reduce(loss)  # every rank's share of the global loss: the mean over the 4 data shards
    return [loss / 4, out[3]]


@pytest.mark.parametrize("kind", ["clip"])
def test_expert_parallel_ranks_gather_each_others_negatives(kind: str) -> None:
    results = run_distributed(gather_over_batch_group, kind, world_size=4)
    image, text = (torch.cat(tensors) for tensors in zip(*(features(rank, 3) for rank in range(4)), strict=True))
    ref = loss_and_grads(kind, image, text, None, None)
    for loss, _ in results:
        torch.testing.assert_close(loss, ref[0], rtol=1e-12, atol=0)
