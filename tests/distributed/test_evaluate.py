"""validate, test and predict after fit, and in a fresh process from the checkpoint, give what one process gives
under every strategy family: evaluation runs the parallelized model (shards, tensor-parallel layers, pipeline
stages). After fit the module's ``model`` is the user's whole network again, holding the trained weights.

Validation and test read the same 2 batches per data-parallel rank (the recipe's test split is its validation
split), and no sampler padding arises; predict reads 7 samples in batches of 4, so under a pipeline a batch of 3
does not split into 2 microbatches and is padded (its outputs cut off again), and with 2 data-parallel ranks one
rank predicts 4 samples and the other 3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, SGDGPTModule, quiet_trainer
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightscale.recipes.gpt import GPT, GPTConfig, GPTDataModule
from lightscale.testing import run_distributed

PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
DATA_PARALLEL = {"tp2": 1, "pp2": 1}
TOLERANCE = 1e-5
PREDICT_SAMPLES = 7


class PredictingGPT(SGDGPTModule):
    """Predicts ``(sample index, logits)``, so predictions from any layout of ranks match up with one process's."""

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> tuple[Tensor, Tensor]:
        index, tokens = batch
        return index, self(tokens)


def _predict_loader(config: GPTConfig) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (PREDICT_SAMPLES, config.block_size), generator=generator)
    return DataLoader(TensorDataset(torch.arange(PREDICT_SAMPLES), tokens), batch_size=4)


def _by_sample(batches: list[tuple[Tensor, Tensor]]) -> dict[int, Tensor]:
    return {int(i): logits for index, out in batches for i, logits in zip(index, out, strict=True)}


def _whole_weights(network: torch.nn.Module) -> dict[str, Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in network.named_parameters()
    }


def _run(trainer: pl.Trainer, module: PredictingGPT, data: GPTDataModule, **ckpt: str) -> dict[str, Any]:
    config = module.config
    return {
        "val": trainer.validate(module, data, verbose=False, **ckpt)[0]["val/loss"],
        "test": trainer.test(module, data, verbose=False, **ckpt)[0]["test/loss"],
        "predict": _by_sample(trainer.predict(module, _predict_loader(config), **ckpt)),
    }


def _trainer(strategy: str, devices: int) -> pl.Trainer:
    return quiet_trainer(strategy, devices=devices, max_steps=4, limit_val_batches=2, limit_test_batches=2)


def _evaluate(strategy: str, cache_dir: str, checkpoint: str, *, fit: bool) -> dict[str, Any]:
    config = PIPELINED if strategy == "pp2" else TINY
    ranks = dist.get_world_size()
    pl.seed_everything(1234, verbose=False)
    module = PredictingGPT(config)
    data = GPTDataModule(
        block_size=config.block_size, batch_size=8 // DATA_PARALLEL.get(strategy, ranks), cache_dir=cache_dir
    )
    trainer = _trainer(strategy, ranks)
    if fit:
        trainer.fit(module, data)
        trainer.save_checkpoint(checkpoint)
        out = _run(trainer, module, data)
    else:
        out = _run(trainer, module, data, ckpt_path=checkpoint)
    # The user's whole network is back in place after fit, with the trained weights in every layer.
    out["whole_network"] = isinstance(module.model, GPT)
    out["weights"] = _whole_weights(module.model) if fit and strategy in ("tp2", "pp2") else None
    return out


@pytest.fixture(scope="module")
def reference(corpus_cache: str) -> dict[bool, dict[str, Any]]:
    return {pipelined: run_distributed(_reference, pipelined, corpus_cache, world_size=1)[0] for pipelined in (0, 1)}


def _reference(pipelined: bool, cache_dir: str) -> dict[str, Any]:
    config = PIPELINED if pipelined else TINY
    pl.seed_everything(1234, verbose=False)
    module = PredictingGPT(config)
    data = GPTDataModule(block_size=config.block_size, batch_size=8, cache_dir=cache_dir)
    trainer = _plain_trainer()
    trainer.fit(module, data)
    return {**_run(trainer, module, data), "weights": _whole_weights(module.model)}


def _plain_trainer() -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        limit_test_batches=2,
    )


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "zero2", "zero3", "fsdp2", "parallel_3d", "tp2", "pp2"])
def test_evaluate_after_fit_and_in_a_fresh_process(
    strategy: str, reference: dict[bool, dict[str, Any]], corpus_cache: str, tmp_path: Any
) -> None:
    checkpoint = str(tmp_path / "model.ckpt")
    after_fit = run_distributed(_evaluate, strategy, corpus_cache, checkpoint, fit=True, world_size=2, timeout_s=300)
    fresh = run_distributed(_evaluate, strategy, corpus_cache, checkpoint, fit=False, world_size=2, timeout_s=300)
    expected = reference[strategy == "pp2"]
    for rank in [*after_fit, *fresh]:
        for metric in ("val", "test"):
            assert abs(rank[metric] - expected[metric]) / expected[metric] <= TOLERANCE, metric
        assert rank["whole_network"]
    for results in (after_fit, fresh):  # every sample predicted once across data-parallel ranks, as one process
        predicted = {i: logits for rank in results for i, logits in rank["predict"].items()}
        assert sorted(predicted) == list(range(PREDICT_SAMPLES))
        for i, logits in predicted.items():
            torch.testing.assert_close(logits, expected["predict"][i], rtol=TOLERANCE, atol=TOLERANCE)
    for rank in after_fit:  # under tp and pp every rank's network holds every trained layer
        if rank["weights"] is not None:
            assert rank["weights"].keys() == expected["weights"].keys()
            for name, weight in rank["weights"].items():
                torch.testing.assert_close(weight, expected["weights"][name], rtol=TOLERANCE, atol=TOLERANCE)
