"""Contrastive losses over the global batch: one cross-rank feature gather with gradient, for every strategy.

Why it is exact. Rank ``r`` of ``W`` data-parallel ranks holds ``n`` of the ``N = W n`` pairs. It gathers every
rank's features (one collective, with gradient) and scores only its own rows against all columns: logits are
``n x N`` (open_clip's ``local_loss``), labels offset by ``r n``. The global loss is the mean over ranks of these
local losses, so ``dL/dθ = 1/W Σ_r dL_r/dθ``. Backward of the gather sends each rank's column gradients back to
the rank that owns those features and sums them (a reduce-scatter SUM), so each rank's features receive
``Σ_r dL_r/d(features)``; its towers turn that into its share of ``Σ_r dL_r/dθ``. Every lightscale strategy then
*averages* gradients over the data-parallel ranks - bucketed_ddp's all-reduce, ZeRO's and FSDP2's reduce-scatter,
HSDP's both, parallel_3d's dp axes - which supplies the ``1/W``. A parameter used on every rank outside the gather
(the logit scale) gets ``1/W Σ_r dL_r/dscale`` the same way. Tensor- and pipeline-parallel ranks share a batch,
so the gather spans the ranks with batches of their own only (:func:`data_parallel_group`: dp x ep).

Uneven batches: ``pad_to`` pads this rank's rows to a size every rank agrees on and gathers a validity column in
the same collective; padded rows and columns are masked and the loss is normalized by the true global count.

Example:
    >>> loss = clip_loss(image_features, text_features, logit_scale, group=data_parallel_group(trainer.strategy))
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightscale.parallel.mesh import batch_mesh
from lightscale.runtime.collectives import all_gather_single, reduce_scatter_single

_GROUPS: weakref.WeakKeyDictionary[Any, ProcessGroup | None] = weakref.WeakKeyDictionary()


def data_parallel_group(strategy: Any) -> ProcessGroup | None:
    """The ranks that hold different batches under ``strategy`` (None: one process). Cached per strategy.

    lightscale strategies: the ranks with batches of their own, ``dp x ep`` (parallel/mesh.py ``batch_mesh``; the
    whole world unless tensor, context or pipeline parallelism is on). Any other strategy: the world.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if strategy not in _GROUPS:
        dims = getattr(strategy, "dims", None)
        whole = dims is None or dims.data_shards == dims.world_size
        _GROUPS[strategy] = dist.group.WORLD if whole else batch_mesh(strategy.device_mesh).get_group()
    return _GROUPS[strategy]


class _GatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums every rank's gradient for this rank's rows."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = local.new_empty((world * local.shape[0], *local.shape[1:]))
        all_gather_single(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
            reduce_scatter_single(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter: all-reduce and keep this rank's rows
        return grad.chunk(world)[rank], None


def gather_with_grad(local: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[n, ...] -> [W n, ...]`` in rank order, differentiable; the identity without a group of > 1 ranks."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    return _GatherWithGrad.apply(local, group)


@dataclass
class GlobalBatch:
    """Every rank's features in rank order (padded rows included) and which rows are real."""

    features: list[Tensor]
    valid: Tensor  # bool [W m]
    offset: int  # this rank's first row
    world: int


def gather_batch(*local: Tensor, group: ProcessGroup | None, pad_to: int | None = None) -> GlobalBatch:
    """Gather features of this rank's ``n`` samples (one collective for all of them and the validity mask)."""
    n = local[0].shape[0]
    m = n if pad_to is None else pad_to
    if n > m:
        raise ValueError(f"local batch of {n} exceeds pad_to={m}")
    widths = [x.shape[1] for x in local]
    packed = torch.cat([*local, local[0].new_ones(n, 1)], dim=1)  # the last column marks real rows
    packed = F.pad(packed, (0, 0, 0, m - n))
    full = gather_with_grad(packed, group)
    *features, valid = full.split([*widths, 1], dim=1)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    return GlobalBatch(features=features, valid=valid[:, 0] > 0.5, offset=rank * m, world=world)


def _masked(logits: Tensor, valid: Tensor) -> Tensor:
    return logits if bool(valid.all()) else logits.masked_fill(~valid, float("-inf"))


def clip_loss(
    image: Tensor, text: Tensor, logit_scale: Tensor, *, group: ProcessGroup | None, pad_to: int | None = None
) -> Tensor:
    """Symmetric InfoNCE (CLIP) of this rank's pairs against the global batch: ``n x N`` logits per direction.

    ``image``/``text`` are L2-normalized ``[n, D]``; ``logit_scale`` is the (already exponentiated) temperature.
    Returns this rank's share: ``W / N_real * Σ_local``, so the mean over ranks is the global loss.
    """
    batch = gather_batch(image, text, group=group, pad_to=pad_to)
    all_image, all_text = batch.features
    n = image.shape[0]
    labels = torch.arange(n, device=image.device) + batch.offset
    per_image = _masked(logit_scale * image @ all_text.T, batch.valid)
    per_text = _masked(logit_scale * text @ all_image.T, batch.valid)
    assert per_image.shape == per_text.shape == (n, batch.valid.shape[0]), "local loss: N_local x N_global logits"
    total = F.cross_entropy(per_image, labels, reduction="sum") + F.cross_entropy(per_text, labels, reduction="sum")
    return total / 2 * batch.world / batch.valid.sum()


def siglip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    *,
    group: ProcessGroup | None,
    pad_to: int | None = None,
) -> Tensor:
    """Sigmoid loss (SigLIP, Zhai et al. 2023): every image against every text, ``-1/N Σ_ij log sigmoid(z_ij s_ij)``.

    Only the text features are gathered; this rank scores its ``n`` images against all ``N`` texts, so each pair
    is scored on exactly one rank. Returns this rank's share, as :func:`clip_loss` does.
    """
    batch = gather_batch(text, group=group, pad_to=pad_to)
    (all_text,) = batch.features
    n = image.shape[0]
    logits = logit_scale * image @ all_text.T + logit_bias
    assert logits.shape == (n, batch.valid.shape[0]), "local loss: N_local x N_global logits"
    signs = -torch.ones_like(logits)
    signs[torch.arange(n), torch.arange(n) + batch.offset] = 1.0
    pair_losses = -F.logsigmoid(signs * logits) * batch.valid  # padded texts contribute nothing
    return pair_losses.sum() * batch.world / batch.valid.sum()
