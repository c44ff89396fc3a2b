"""GPTModule: a tiny config learns on the default corpus; the learning-rate schedule has the promised shape."""

import itertools
import math

import lightning.pytorch as pl
import pytest
import torch

from lightscale.recipes.gpt import GPTConfig, GPTDataModule, GPTModule
from lightscale.recipes.gpt.model import flops_per_token
from lightscale.recipes.gpt.module import warmup_cosine


class Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.flops: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())
        self.flops.append(pl_module.flops_per_batch)


def test_tiny_gpt_loss_falls_on_default_corpus(tmp_path):
    pl.seed_everything(0, verbose=False)
    config = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
    module = GPTModule(config, learning_rate=3e-3, warmup_steps=5)
    data = GPTDataModule(block_size=64, batch_size=8, cache_dir=str(tmp_path))
    record = Record()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=4,
        num_sanity_val_steps=0,
        val_check_interval=30,
        callbacks=[record],
    )
    trainer.fit(module, data)
    assert len(record.losses) == 30
    assert record.losses[0] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at init
    first, last = sum(record.losses[:5]) / 5, sum(record.losses[-5:]) / 5
    assert last < first - 1.2 and last < 4.0, record.losses  # ~5.2 -> ~3.4 on this seed
    assert trainer.callback_metrics["val/loss"] < 4.2
    assert record.flops[-1] == flops_per_token(config) * 8 * 64
    # Warmup to the peak at step 4, then cosine towards min_lr_ratio * lr at max_steps.
    assert record.lrs[0] == pytest.approx(3e-3 / 5)
    assert record.lrs[4] == pytest.approx(3e-3)
    assert all(a >= b for a, b in itertools.pairwise(record.lrs[4:]))
    assert record.lrs[-1] == pytest.approx(3e-3 * warmup_cosine(29, warmup_steps=5, max_steps=30, min_lr_ratio=0.1))


def test_weight_decay_skips_norms_and_biases():
    module = GPTModule(GPTConfig(bias=True))
    module.configure_model()
    module.trainer = pl.Trainer(max_steps=100, logger=False, enable_progress_bar=False)
    decay, no_decay = module.configure_optimizers()["optimizer"].param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == module.model.num_params()


def test_schedule_shape():
    lr = [warmup_cosine(s, warmup_steps=10, max_steps=110, min_lr_ratio=0.1) for s in range(120)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)  # linear warmup
    assert lr[10] == pytest.approx(1.0) and lr[60] == pytest.approx(0.55)  # cosine midpoint
    assert lr[110] == pytest.approx(0.1) and lr[119] == pytest.approx(0.1)  # floor, then held
    assert all(a >= b for a, b in itertools.pairwise(lr[10:]))
    constant = [warmup_cosine(s, warmup_steps=4, max_steps=-1, min_lr_ratio=0.1) for s in range(50)]
    assert constant[3:] == [1.0] * 47


def test_module_validates_hyperparameters():
    with pytest.raises(ValueError, match="min_lr_ratio must be in"):
        GPTModule(min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="learning_rate > 0"):
        GPTModule(learning_rate=0.0)


def test_forward_matches_model():
    module = GPTModule(GPTConfig(block_size=16))
    module.configure_model()
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(module(tokens), module.model(tokens))


def test_model_is_built_in_configure_model_once():
    module = GPTModule(GPTConfig(block_size=16))
    assert module.model is None  # so a strategy's init context (zero.Init, meta device) wraps its construction
    module.configure_model()
    built = module.model
    module.configure_model()
    assert module.model is built
