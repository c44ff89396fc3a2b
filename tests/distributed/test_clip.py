"""The contrastive loss is exact under every strategy: gradients and SGD losses equal one process on the global batch.

One process trains the tiny CLIP on the global batch of 8 pairs; W ranks train on 8/W pairs each, gathering
features across the data-parallel group. After the first backward every parameter's gradient (the logit scale
included), gathered whole from whatever shards the strategy keeps, must equal the single-process gradient; over
10 plain-SGD steps the mean of the ranks' losses must equal the single-process losses. A gather without gradient
(open_clip's ``gather_with_grad=False``) fails the same comparison.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import quiet_trainer, relative_difference
from torch.distributed.tensor import DTensor

from lightscale.parallel import contrastive
from lightscale.recipes.clip import CLIPConfig, CLIPDataModule, CLIPModule, TextConfig
from lightscale.recipes.vit.model import ViTConfig
from lightscale.strategies import Parallel3DStrategy, ZeroStrategy
from lightscale.testing import run_distributed

# Relative, fp32: the whole gradient (every parameter concatenated), and each parameter on its own. A parameter whose
# gradient is ~1000x smaller than the largest (a LayerNorm bias) shows the fp32 reassociation noise of the large
# sums upstream of it: measured worst 1.9e-6 per parameter, ~3e-7 whole.
GRAD_TOLERANCE = 1e-6
PER_PARAMETER_TOLERANCE = 1e-5
LOSS_TOLERANCE = 1e-5
STEPS = 10
GLOBAL_BATCH = 8
TINY = CLIPConfig(
    vision=ViTConfig.named("tiny", num_classes=0, n_embd=16),
    text=TextConfig(context_length=24, n_layer=1, n_head=2, n_embd=16),
    embed_dim=16,
)
RANKS = {"hsdp": 4}


class SGDCLIP(CLIPModule):
    """The recipe's module with plain SGD (a wrong gradient scale is a wrong step) and no augmentation."""

    def __init__(self, loss: str) -> None:
        super().__init__(TINY, loss=loss, max_shift=0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def full_grad(strategy: Any, param: torch.Tensor) -> torch.Tensor:
    """The whole gradient of ``param`` whichever way the strategy holds it (ZeRO partition, DTensor shard, full)."""
    if isinstance(strategy, ZeroStrategy):
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param).detach().clone()
    grad = param.grad
    return (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()


class Record(pl.Callback):
    """The first step's gradients and every step's local loss (this rank's share, before any reduction)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {name: full_grad(trainer.strategy, p) for name, p in module.named_parameters()}

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def no_grad_gather(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The mistake: other ranks' features gathered as constants, only this rank's rows carry gradient."""
    if group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    parts[dist.get_rank(group)] = local
    return torch.cat(parts)


def fit(
    strategy: Any, devices: int, loss: str, root: str, mistake: bool = False, dp: int | None = None
) -> tuple[dict, list[float]]:
    if mistake:
        contrastive.gather_with_grad = no_grad_gather  # this forked rank only
    pl.seed_everything(1234, verbose=False)
    record = Record()
    trainer = quiet_trainer(strategy, devices=devices, max_steps=STEPS, callbacks=[record], default_root_dir=root)
    data = CLIPDataModule(batch_size=GLOBAL_BATCH // (dp or devices), context_length=TINY.text.context_length)
    trainer.fit(SGDCLIP(loss), data)
    return record.grads, record.losses


@cache
def reference(loss: str, root: str) -> tuple[dict, list[float]]:
    return run_distributed(fit, "auto", 1, loss, root, world_size=1)[0]


def grad_differences(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(relative difference of the whole gradient, worst relative difference of one parameter's gradient)."""
    assert set(grads) == set(reference)
    delta = torch.cat([(grads[k] - reference[k]).flatten() for k in reference])
    whole = float(delta.norm() / torch.cat([g.flatten() for g in reference.values()]).norm())
    return whole, max(float((grads[k] - reference[k]).norm() / reference[k].norm()) for k in reference)


def compare(
    name: Any, loss: str, root: str, ranks: int = 2, mistake: bool = False, dp: int | None = None
) -> tuple[float, float, float]:
    """(whole-gradient and worst per-parameter relative difference, worst relative loss difference over steps)."""
    per_rank = run_distributed(fit, name, ranks, loss, root, mistake, dp, world_size=ranks, timeout_s=600)
    # Ranks sharing a batch (tensor parallel) hold the same loss: the mean over all ranks is still the global one.
    grads, losses = per_rank[0][0], [sum(step) / ranks for step in zip(*(r[1] for r in per_rank), strict=True)]
    ref_grads, ref_losses = reference(loss, root)
    assert ref_losses[-1] < ref_losses[0]  # it learned: the comparison is not vacuous
    return (*grad_differences(grads, ref_grads), relative_difference(losses, ref_losses))


def assert_exact(whole: float, per_parameter: float, loss_diff: float) -> None:
    print(f"gradient rel diff {whole:.2e} (worst parameter {per_parameter:.2e}), loss rel diff {loss_diff:.2e}")
    assert whole <= GRAD_TOLERANCE
    assert per_parameter <= PER_PARAMETER_TOLERANCE
    assert loss_diff <= LOSS_TOLERANCE


@pytest.mark.parametrize("name", ["bucketed_ddp", "zero2", "zero3", "fsdp2", "hsdp", "parallel_3d"])
def test_clip_loss_is_exact_under_every_strategy(name: str, tmp_path: Any) -> None:
    assert_exact(*compare(name, "clip", str(tmp_path), RANKS.get(name, 2)))


@pytest.mark.parametrize("name", ["bucketed_ddp", "zero2", "zero3", "fsdp2", "hsdp"])
def test_siglip_loss_is_exact(name: str, tmp_path: Any) -> None:
    assert_exact(*compare(name, "siglip", str(tmp_path), RANKS.get(name, 2)))


@pytest.mark.parametrize("name", ["bucketed_ddp", "fsdp2"])
def test_a_gather_without_gradient_fails_the_comparison(name: str, tmp_path: Any) -> None:
    whole, _, loss_diff = compare(name, "clip", str(tmp_path), mistake=True)
    print(f"without gradient through the gather: gradient rel diff {whole:.2e}, loss rel diff {loss_diff:.2e}")
    assert whole > 1000 * GRAD_TOLERANCE
    assert loss_diff > 100 * LOSS_TOLERANCE


def test_clip_data_parallel_under_tensor_parallel(tmp_path: Any) -> None:
    # dp=2 x tp=2: the gather spans the 2 data-parallel ranks, not the 4 processes.
    assert_exact(*compare(Parallel3DStrategy(dp=2, tp=2), "clip", str(tmp_path), ranks=4, dp=2))
