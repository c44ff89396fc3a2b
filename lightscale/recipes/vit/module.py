"""LightningModule for the ViT recipe: image classification with accuracy, AdamW, warmup + cosine learning rate.

Example:
    >>> module = ViTModule(ViTConfig.named("small"), learning_rate=3e-3)
    >>> lightscale.Trainer(strategy="fsdp2", accelerator="cpu", devices=2, max_steps=300).fit(
    ...     module, ImageDataModule(batch_size=64))
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightscale.checkpoint import allow_in_checkpoints
from lightscale.parallel.tensor_parallel import TPPlan
from lightscale.recipes.gpt.module import warmup_cosine
from lightscale.recipes.vit.model import ViT, ViTConfig, flops_per_image
from lightscale.recipes.vit.parallelize import validate_vit_parallel, vit_stage_modules, vit_tp_plan

allow_in_checkpoints(ViTConfig)


def random_shift(images: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels (zero fill): a cheap, label-preserving augmentation."""
    if max_shift <= 0:
        return images
    n, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4, value=float(images.min()))
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n)).tolist()
    return torch.stack([padded[i, :, y : y + h, x : x + w] for i, (y, x) in enumerate(zip(dy, dx, strict=True))])


def adamw_with_schedule(module: pl.LightningModule, hp: Any) -> dict[str, Any]:
    """AdamW, weight decay on Linear matrices only, stepped warmup-cosine schedule (shared with the CLIP recipe)."""
    params = [p for p in module.parameters() if p.requires_grad]
    # Chosen by module, not by p.ndim: a ZeRO-3 partition or a sharded parameter need not keep its logical shape.
    matrices = {id(m.weight) for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    groups = [
        {"params": [p for p in params if id(p) in matrices], "weight_decay": hp.weight_decay},
        {"params": [p for p in params if id(p) not in matrices], "weight_decay": 0.0},
    ]
    groups = [group for group in groups if group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
    schedule = partial(
        warmup_cosine, warmup_steps=hp.warmup_steps, max_steps=module.trainer.max_steps, min_lr_ratio=hp.min_lr_ratio
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class ViTModule(pl.LightningModule):
    """Trains :class:`ViT` on ``(images, labels)`` batches; plain typed arguments so LightningCLI can build it."""

    def __init__(
        self,
        config: ViTConfig | None = None,
        *,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.05,
        max_shift: int = 0,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if learning_rate <= 0 or weight_decay < 0 or warmup_steps < 0 or max_shift < 0:
            raise ValueError("need learning_rate > 0 and weight_decay, warmup_steps, max_shift >= 0")
        self.save_hyperparameters()
        self.config = config or ViTConfig()
        self.model: ViT | None = None  # built in configure_model, inside the strategy's init context
        self.flops_per_image = flops_per_image(self.config)
        self.flops_per_batch: int = self.flops_per_image  # read by throughput callbacks; updated per batch

    @override
    def configure_model(self) -> None:
        if self.model is None:  # idempotent: Lightning calls it again for every fit/validate/test
            self.model = ViT(self.config)

    @override
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first (Trainer does)"
        return self.model(images)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return self.loss_fn(self(images), labels)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; also the last pipeline stage's loss per microbatch."""
        return F.cross_entropy(plain(logits).float(), labels, label_smoothing=self.hparams.label_smoothing)

    # ---- the model contract (lightscale/parallel/contract.py) ------------------------------------------------
    def sharding_units(self) -> list[nn.Module]:
        assert self.model is not None
        return [layer for layer in self.model.layers.values() if layer is not None]  # a stage holds some

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
        return vit_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def validate_parallelism(self, *, tp: int, num_stages: int, sequence_parallel: bool, loss_parallel: bool) -> None:
        validate_vit_parallel(self.config, tp=tp, num_stages=num_stages, sequence_parallel=sequence_parallel)

    def pipeline_stages(self, num_stages: int) -> list[list[str]]:
        return vit_stage_modules(self.config, num_stages)

    # ---- steps -----------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flops_per_batch = self.flops_per_image * len(batch[0])

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = self.loss((random_shift(images, self.hparams.max_shift), labels))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], prefix: str) -> torch.Tensor:
        images, labels = batch
        if "loss" in vars(self):  # a pipeline serves self.loss (parallel_3d, pp > 1): it returns the loss only
            loss = self.loss(batch)
        else:
            logits = plain(self(images))
            loss = self.loss_fn(logits, labels)
            accuracy = (logits.argmax(-1) == labels).float().mean()
            self.log(f"{prefix}/acc", accuracy, sync_dist=True, prog_bar=True, batch_size=len(labels))
        self.log(f"{prefix}/loss", loss, sync_dist=True, batch_size=len(labels))
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "val")

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._evaluate(batch, "test")

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_with_schedule(self, self.hparams)
