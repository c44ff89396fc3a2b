"""LightningModule for the GPT recipe: next-token cross-entropy, AdamW, warmup + cosine learning rate.

Example:
    >>> module = GPTModule(GPTConfig(n_layer=2, n_head=2, n_embd=64), learning_rate=3e-3)
    >>> lightscale.Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2, max_steps=50).fit(
    ...     module, GPTDataModule(block_size=128, batch_size=8))
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightscale.checkpoint import allow_in_checkpoints
from lightscale.errors import ConfigurationError
from lightscale.layers.moe import MoE, MoEConfig, load_imbalance, update_router_biases
from lightscale.parallel.contract import TransformerShape
from lightscale.parallel.tensor_parallel import TPPlan
from lightscale.recipes.gpt.data import GPTDataModule
from lightscale.recipes.gpt.model import GPT, GPTConfig, flops_per_token
from lightscale.recipes.gpt.parallelize import (
    gpt_stage_modules,
    gpt_tp_plan,
    validate_gpt_moe,
    validate_gpt_parallel,
    validate_gpt_plan,
)

allow_in_checkpoints(GPTConfig, MoEConfig)  # saved in hyper-parameters; a plain dataclass, safe to load weights-only


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier after ``step`` optimizer steps: linear warmup, then cosine to ``min_lr_ratio`` at ``max_steps``.

    ``max_steps=-1`` (no end known) keeps the multiplier at 1 after warmup.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps  # +1: the first step already learns instead of using lr=0
    if max_steps < 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(pl.LightningModule):
    """Trains :class:`GPT` on ``(tokens, targets)`` batches; plain typed arguments so LightningCLI can build it."""

    def __init__(
        self,
        config: GPTConfig | None = None,
        *,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if learning_rate <= 0 or weight_decay < 0 or warmup_steps < 0:
            raise ValueError(
                f"need learning_rate > 0, weight_decay >= 0, warmup_steps >= 0; "
                f"got {learning_rate}, {weight_decay}, {warmup_steps}"
            )
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.save_hyperparameters()
        self.config = config or GPTConfig()
        self.model: GPT | None = None  # built in configure_model, inside the strategy's init context
        self.flops_per_token = flops_per_token(self.config)
        # Read by throughput callbacks; one full sequence until the first batch tells the real size.
        self.flops_per_batch: int = self.flops_per_token * self.config.block_size

    @override
    def setup(self, stage: str) -> None:
        """Refuse data whose tokens the embedding cannot look up (Lightning sets the datamodule up first)."""
        data = self.trainer.datamodule
        vocab = data.vocab_size if isinstance(data, GPTDataModule) else None
        if vocab is not None and vocab > self.config.vocab_size:
            raise ConfigurationError(
                f"The data's vocabulary has {vocab} tokens but the model's vocab_size is {self.config.vocab_size}: "
                f"token ids up to {vocab - 1} would index past the embedding. Valid: model config vocab_size >= "
                f"{vocab} (GPT-2's 50257 tokens: 50304, a multiple of 64)."
            )

    @override
    def configure_model(self) -> None:
        """Build the model here, not in ``__init__``: Lightning calls this inside the strategy's init context
        (``deepspeed.zero.Init`` under zero3, the meta device under FSDP2), so no rank holds the full model."""
        if self.model is None:  # idempotent: Lightning calls it again for every fit/validate/test
            self.model = GPT(self.config)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "call configure_model() first (Trainer does)"
        return self.model(tokens)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        loss = self.loss_fn(self(tokens), targets)
        # The MoE balancing losses train the router; evaluation reports the language-model loss alone.
        return loss + self.moe_aux_loss() if self.config.moe is not None and self.training else loss

    # ---- mixture of experts ----------------------------------------------------------------------------------
    def moe_slots(self) -> list[MoE | None]:
        """Every MoE layer of the config in order; ``None`` where this rank's pipeline stages lack the layer."""
        assert self.model is not None and self.config.moe is not None
        indices = [i for i in range(self.config.n_layer) if self.config.moe.is_moe_layer(i)]
        layers = {name: layer for name, layer in self.model.layers.items() if layer is not None}
        return [layers[str(i)].feed_forward if str(i) in layers else None for i in indices]

    def moe_aux_loss(self) -> torch.Tensor:
        """The balancing and z-losses of the last forward (zero under ``balance: bias`` without a z-loss)."""
        losses = [layer.aux_loss for layer in self.moe_slots() if layer is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def _log_moe(self) -> None:
        """Tokens per expert (max/mean, and a TensorBoard histogram), dropped fraction and aux loss, per MoE layer."""
        histogram = self.trainer.global_step % self.trainer.log_every_n_steps == 0
        for index, layer in enumerate(self.moe_slots()):
            if layer is not None:
                routed = float(layer.counts.sum())
                self.log(f"moe/layer{index}/max_over_mean", load_imbalance(layer.counts))
                self.log(f"moe/layer{index}/dropped_fraction", layer.dropped / max(routed, 1.0))
                if histogram:
                    self._log_expert_histogram(f"moe/layer{index}/tokens_per_expert", layer.counts)
        self.log("moe/aux_loss", self.moe_aux_loss())

    def _log_expert_histogram(self, tag: str, counts: torch.Tensor) -> None:
        experts = torch.repeat_interleave(torch.arange(len(counts)), counts.long())
        edges = np.arange(len(counts) + 1) - 0.5  # one bin per expert
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_histogram(tag, experts, self.global_step, bins=edges)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        moe = self.config.moe
        if moe is not None and moe.balance == "bias":  # once per optimizer step: accumulation does not change it
            update_router_biases(self.moe_slots(), n_experts=moe.n_experts)

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; also the last pipeline stage's loss per microbatch."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        # Under loss_parallel (vocab-sharded logits) the loss is a replicated DTensor: hand back a plain tensor.
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    # ---- the model contract (lightscale/parallel/contract.py) ------------------------------------------------
    def sharding_units(self) -> list[nn.Module]:
        assert self.model is not None
        return [layer for layer in self.model.layers.values() if layer is not None]  # a stage holds some

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
        return gpt_tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, config=self.config)

    def validate_parallelism(self, *, tp: int, num_stages: int, sequence_parallel: bool, loss_parallel: bool) -> None:
        validate_gpt_parallel(self.config, tp=tp, num_stages=num_stages)
        validate_gpt_moe(self.config, tp=tp, num_stages=num_stages)
        if tp > 1:
            validate_gpt_plan(self.config, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)

    def pipeline_stages(self, num_stages: int) -> list[list[str]]:
        return gpt_stage_modules(self.config, num_stages)

    def transformer_shape(self) -> TransformerShape:
        c = self.config
        return TransformerShape(
            layers=c.n_layer,
            hidden=c.n_embd,
            heads=c.n_head,
            seq_len=c.block_size,
            vocab_size=c.vocab_size,
            kv_heads=c.n_kv_head,
            dropout=c.dropout > 0,
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flops_per_batch = self.flops_per_token * batch[0].numel()

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        if self.config.moe is not None:
            self._log_moe()
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        return loss

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        # Weight decay on matrices only (nanoGPT): decaying LayerNorm gains and biases only hurts. Chosen by
        # module, not by p.ndim: a ZeRO-3 partition or a sharded parameter need not keep its logical shape.
        matrices = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        groups = [
            {"params": [p for p in params if id(p) in matrices], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if id(p) not in matrices], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]]  # engines drop empty groups; keep LR lists aligned
        optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        schedule = partial(
            warmup_cosine,
            warmup_steps=hp.warmup_steps,
            max_steps=self.trainer.max_steps,
            min_lr_ratio=hp.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
