"""Throughput on 2 CPU ranks: MFU is logged (against a measured matmul peak), and with gradient accumulation every
micro-batch's tokens and FLOPs count once per optimizer step, whether the module declares its FLOPs or not."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from helpers import TINY
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightscale
from lightscale.callbacks import Throughput
from lightscale.recipes.gpt import GPTDataModule, GPTModule
from lightscale.testing import run_distributed


class Collect(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    name = "collect"
    version = 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class Counted(GPTModule):
    """Declares no FLOPs: the callback counts them once."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flops_per_batch = None


def _fit(module_class: type, cache_dir: str) -> tuple[list[dict[str, float]], list[tuple[float, float, float]], int]:
    meter, logger = Throughput(), Collect()
    module = module_class(TINY, learning_rate=3e-3, warmup_steps=2)
    trainer = lightscale.Trainer(
        strategy="bucketed_ddp",
        accelerator="cpu",
        devices=2,
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[meter],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, GPTDataModule(block_size=TINY.block_size, batch_size=2, cache_dir=cache_dir))
    return logger.metrics, meter.totals, GPTModule(TINY).flops_per_token


@pytest.mark.parametrize("module_class", [GPTModule, Counted], ids=["module_flops", "counted"])
def test_mfu_logged_on_cpu_and_accumulation_counted_once(module_class: type, corpus_cache: str) -> None:
    metrics, totals, flops_per_token = run_distributed(_fit, module_class, corpus_cache, world_size=2)[0]
    mfu = [m["throughput/mfu"] for m in metrics if "throughput/mfu" in m]
    assert len(mfu) == 3 and all(0 < value < 1.5 for value in mfu)  # steps 2-4; the first is warm-up
    for flops, tokens, samples in totals:
        assert samples == 2 * 2 * 2  # batch x accumulation x data-parallel ranks, once each
        assert tokens == samples * TINY.block_size
        tolerance = 0 if module_class is GPTModule else 0.05  # counted: flash attention's backward recompute
        assert flops == pytest.approx(flops_per_token * tokens, rel=tolerance)


def _fit_pipeline(cache_dir: str) -> tuple[list[tuple[float, float, float]], int]:
    config = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
    meter = Throughput()
    trainer = lightscale.Trainer(
        strategy="pp2",
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        callbacks=[meter],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(GPTModule(config), GPTDataModule(block_size=config.block_size, batch_size=4, cache_dir=cache_dir))
    return meter.totals, GPTModule(config).flops_per_token


def test_pipeline_counts_each_batch_once(corpus_cache: str) -> None:
    # pp2: both ranks run the same batch through their stages, 2 microbatches each: one data-parallel batch.
    for totals, flops_per_token in run_distributed(_fit_pipeline, corpus_cache, world_size=2):
        assert len(totals) == 2
        for flops, tokens, samples in totals:
            assert (samples, tokens) == (4, 4 * TINY.block_size)
            assert flops == flops_per_token * tokens
