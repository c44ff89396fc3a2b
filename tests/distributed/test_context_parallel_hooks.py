"""Context parallelism hooks a user's Hugging Face model only while lightscale runs it: the forward pre-hooks that
give it global positions (lightscale/parallel/context_parallel/hf_positions.py) are there during fit and validate,
and gone after each (the strategy's teardown), so the model a user keeps, saves or generates with is as they built it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.parallel.context_parallel.hf_positions import _global_positions
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import run_distributed

transformers = pytest.importorskip("transformers")
VOCAB, SEQ, SAMPLES = 37, 8, 8


def _ours(model: nn.Module) -> int:
    """How many of the model's forward pre-hooks are lightscale's position hook."""
    return sum(hook is _global_positions for module in model.modules() for hook in module._forward_pre_hooks.values())


class HFLanguageModel(pl.LightningModule):
    """The user's module: a tiny GPT-2 from transformers, called the way users call it (input_ids only)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=1,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = transformers.GPT2LMHeadModel(config)
        self.hooked: dict[str, int] = {}  # by the Trainer's function: fit (its validation too) or validate

    def _loss(self, batch: Any) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.hooked[self.trainer.state.fn.value] = _ours(self.model)
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.hooked[self.trainer.state.fn.value] = _ours(self.model)
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_then_validate() -> dict[str, int]:
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    module = HFLanguageModel()
    trainer = quiet_trainer(Parallel3DStrategy(cp=2), devices=dist.get_world_size(), max_steps=2, limit_val_batches=1)
    trainer.fit(module, loader)
    after_fit = _ours(module.model)
    trainer.validate(module, loader, verbose=False)
    return {**module.hooked, "after fit": after_fit, "after validate": _ours(module.model)}


def test_position_hooks_live_only_while_lightscale_runs_the_model() -> None:
    for hooked in run_distributed(_fit_then_validate, world_size=2, timeout_s=300):
        both = 2  # GPT2LMHeadModel and the GPT2Model inside it: each takes position_ids
        assert hooked == {"fit": both, "after fit": 0, "validate": both, "after validate": 0}
