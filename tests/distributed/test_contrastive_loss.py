"""The contrastive losses on their own: gradients of features and temperature equal one process, uneven batches
padded and masked, and each rank's logits are N_local x N_global."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightscale.parallel import contrastive
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
