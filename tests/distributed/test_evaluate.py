"""validate after fit, and in a fresh process from the checkpoint, give the single-process metric under every
strategy family: evaluation runs the parallelized model (shards, tensor-parallel layers, pipeline stages)."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from helpers import TINY, SGDGPTModule

import lightscale
from lightscale.recipes.gpt import GPT, GPTDataModule
from lightscale.testing import run_distributed

PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
DATA_PARALLEL = {"tp2": 1, "pp2": 1}
TOLERANCE = 1e-5


def _evaluate(strategy: str, cache_dir: str, checkpoint: str, *, fit: bool) -> tuple[float, bool]:
    config = PIPELINED if strategy == "pp2" else TINY
    ranks = dist.get_world_size()
    pl.seed_everything(1234, verbose=False)
    module = SGDGPTModule(config)
    data = GPTDataModule(
        block_size=config.block_size, batch_size=8 // DATA_PARALLEL.get(strategy, ranks), cache_dir=cache_dir
    )
    trainer = lightscale.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=ranks,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    if fit:
        trainer.fit(module, data)
        trainer.save_checkpoint(checkpoint)
        metric = trainer.validate(module, data, verbose=False)[0]["val/loss"]
    else:
        metric = trainer.validate(module, data, ckpt_path=checkpoint, verbose=False)[0]["val/loss"]
    return metric, isinstance(module.model, GPT)  # after fit the user's whole network is back in place


@pytest.fixture(scope="module")
def reference(corpus_cache: str, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, float]:
    out: dict[bool, float] = {}
    for pipelined in (False, True):
        path = str(tmp_path_factory.mktemp("ref") / "one.ckpt")
        name = "pp2" if pipelined else "auto"  # "pp2" only picks the config here: one process, no strategy
        out[pipelined] = run_distributed(_reference, name, corpus_cache, path, world_size=1)[0]
    return out


def _reference(name: str, cache_dir: str, checkpoint: str) -> float:
    config = PIPELINED if name == "pp2" else TINY
    pl.seed_everything(1234, verbose=False)
    module = SGDGPTModule(config)
    data = GPTDataModule(block_size=config.block_size, batch_size=8, cache_dir=cache_dir)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    trainer.fit(module, data)
    return trainer.validate(module, data, verbose=False)[0]["val/loss"]


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero2", "zero3", "fsdp2", "parallel_3d", "tp2", "pp2"])
def test_validate_after_fit_and_in_a_fresh_process(
    strategy: str, reference: dict[bool, float], corpus_cache: str, tmp_path: Any
) -> None:
    checkpoint = str(tmp_path / "model.ckpt")
    after_fit = run_distributed(_evaluate, strategy, corpus_cache, checkpoint, fit=True, world_size=2, timeout_s=300)
    fresh = run_distributed(_evaluate, strategy, corpus_cache, checkpoint, fit=False, world_size=2, timeout_s=300)
    expected = reference[strategy == "pp2"]
    for metric, whole_network in [*after_fit, *fresh]:
        assert abs(metric - expected) / expected <= TOLERANCE
        assert whole_network
