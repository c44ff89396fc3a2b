"""LightningModule for the CLIP recipe: contrastive (CLIP or SigLIP) training, zero-shot accuracy in validation.

The loss gathers features over the data-parallel group of whatever strategy trains the module (one collective,
with gradient; lightscale/parallel/contrastive.py explains why the gradients are exact under every strategy).

Example:
    >>> module = CLIPModule(CLIPConfig(), loss="clip", learning_rate=5e-4)
    >>> lightscale.Trainer(strategy="zero2", accelerator="cpu", devices=2, max_steps=400).fit(
    ...     module, CLIPDataModule(batch_size=64))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightscale.checkpoint import allow_in_checkpoints
from lightscale.errors import ConfigurationError
from lightscale.parallel.contrastive import clip_loss, data_parallel_group, siglip_loss
from lightscale.parallel.tensor_parallel import TPPlan
from lightscale.recipes.clip.data import TEMPLATES, caption, tokenize
from lightscale.recipes.clip.model import CLIP, CLIPConfig, CLIPOutput, TextConfig, flops_per_pair
from lightscale.recipes.vit.data import DIGIT_NAMES
from lightscale.recipes.vit.model import ViTConfig
from lightscale.recipes.vit.module import adamw_with_schedule, random_shift
from lightscale.recipes.vit.parallelize import block_tp_plan, sequence_entry_exit

allow_in_checkpoints(CLIPConfig, TextConfig, ViTConfig)

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class CLIPModule(pl.LightningModule):
    """Trains :class:`CLIP` on ``(images, tokens, labels)`` batches; ``labels`` feed zero-shot accuracy only.

    Args:
        loss: ``"clip"`` (symmetric InfoNCE over the global batch) or ``"siglip"`` (sigmoid, all pairs).
        pad_to: per-rank batch size every rank pads to, for data whose last batches differ between ranks (the
            recipe's data modules give equal batches, so the default None asserts nothing and pads nothing).
        class_names, templates: zero-shot prompts, ``template.format(name=..., digit=index)`` per class.
    """

    def __init__(
        self,
        config: CLIPConfig | None = None,
        *,
        loss: Literal["clip", "siglip"] = "clip",
        learning_rate: float = 5e-4,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.05,
        max_shift: int = 0,
        pad_to: int | None = None,
        class_names: list[str] | None = None,
        templates: list[str] | None = None,
    ) -> None:
        super().__init__()
        if loss not in ("clip", "siglip"):
            raise ValueError(f"loss must be 'clip' or 'siglip', got {loss!r}")
        if learning_rate <= 0 or weight_decay < 0 or warmup_steps < 0 or max_shift < 0:
            raise ValueError("need learning_rate > 0 and weight_decay, warmup_steps, max_shift >= 0")
        self.save_hyperparameters()
        self.config = config or CLIPConfig()
        if loss == "siglip" and self.config.init_logit_bias is None:
            self.config = dataclasses.replace(self.config, init_logit_bias=-10.0)  # the SigLIP paper's init
        self.model: CLIP | None = None  # built in configure_model, inside the strategy's init context
        self.class_names = list(class_names or DIGIT_NAMES)
        self.templates = list(templates or TEMPLATES)
        self.flops_per_pair = flops_per_pair(self.config)
        self.flops_per_batch: int = self.flops_per_pair
        self.last_logit_scale = torch.ones(1)

    @override
    def configure_model(self) -> None:
        if self.model is None:
            self.model = CLIP(self.config)

    @override
    def forward(self, images: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> CLIPOutput:
        assert self.model is not None, "call configure_model() first (Trainer does)"
        return self.model(images, tokens)

    def group(self) -> Any:
        trainer = self._trainer
        return data_parallel_group(trainer.strategy) if trainer is not None else None

    def contrastive_loss(self, out: CLIPOutput) -> torch.Tensor:
        """This rank's share of the global-batch loss (the mean over data-parallel ranks is the global loss)."""
        assert out.image is not None and out.text is not None
        group, pad_to = self.group(), self.hparams.pad_to
        if self.hparams.loss == "siglip":
            assert out.logit_bias is not None
            return siglip_loss(out.image, out.text, out.logit_scale, out.logit_bias, group=group, pad_to=pad_to)
        return clip_loss(out.image, out.text, out.logit_scale, group=group, pad_to=pad_to)

    def loss(self, batch: Batch, *, augment: bool = False) -> torch.Tensor:
        images, tokens, _ = batch
        out = self(random_shift(images, self.hparams.max_shift) if augment else images, tokens)
        self.last_logit_scale = out.logit_scale.detach()
        return self.contrastive_loss(out)

    # ---- the model contract (lightscale/parallel/contract.py) ------------------------------------------------
    def sharding_units(self) -> list[nn.Module]:
        assert self.model is not None
        return [*self.model.vision.layers.values(), *self.model.text.layers.values()]

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
        plan = block_tp_plan("vision.layers", sequence_parallel=sequence_parallel)
        plan |= block_tp_plan("text.layers", sequence_parallel=sequence_parallel)
        if sequence_parallel:
            plan |= sequence_entry_exit("vision.layers.0", "vision.norm")
            plan |= sequence_entry_exit("text.layers.0", "text.norm")
        return plan

    def validate_parallelism(self, *, tp: int, num_stages: int, sequence_parallel: bool, loss_parallel: bool) -> None:
        if num_stages > 1:
            raise ConfigurationError(
                "The CLIP recipe has no pipeline split (two towers meet in a loss over the global batch); use pp=1."
            )
        vision, text = self.config.vision, self.config.text
        sizes = {"vision n_head": vision.n_head, "vision n_embd": vision.n_embd}
        sizes |= {"text n_head": text.n_head, "text n_embd": text.n_embd}
        if sequence_parallel:
            sizes |= {"vision sequence": vision.seq_len, "text context_length": text.context_length}
        bad = {name: size for name, size in sizes.items() if size % tp}
        if bad:
            raise ConfigurationError(f"Tensor parallel degree tp={tp} does not divide {bad} (it must divide {sizes}).")

    # ---- steps -----------------------------------------------------------------------------------------------
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flops_per_batch = self.flops_per_pair * len(batch[0])

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch, augment=True)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/logit_scale", self.last_logit_scale.float().mean())
        return loss

    def prompt_tokens(self, device: torch.device) -> torch.Tensor:
        texts = [caption(c, t, self.class_names) for c in range(len(self.class_names)) for t in self.templates]
        return tokenize(texts, self.config.text.context_length).to(device)

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        images, tokens, labels = batch
        n = len(tokens)
        # One call embeds the captions and the zero-shot prompts: each call is a full gather under FSDP/ZeRO-3.
        out = self(images, torch.cat([tokens, self.prompt_tokens(tokens.device)]))
        image, text = out.image, out.text
        assert image is not None and text is not None
        loss = self.contrastive_loss(out._replace(text=text[:n]))
        self.log("val/loss", loss, sync_dist=True, batch_size=n)
        classes = text[n:].view(len(self.class_names), len(self.templates), -1).mean(dim=1)  # prompt ensemble
        predictions = (image @ F.normalize(classes, dim=-1).T).argmax(dim=-1)
        known = labels >= 0
        if bool(known.any()):
            accuracy = (predictions[known] == labels[known]).float().mean()
            self.log("val/zero_shot_acc", accuracy, sync_dist=True, prog_bar=True, batch_size=int(known.sum()))
        return loss

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_with_schedule(self, self.hparams)
