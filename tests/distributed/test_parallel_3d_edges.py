"""parallel_3d at its edges: fp16 and bf16 under a pipeline (loss scaled inside the schedule, one skip-or-step
decision for all ranks), and a last batch that does not split into microbatches."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import TINY, SGDGPTModule, relative_difference, train_tiny_gpt
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightscale
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import run_distributed

PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)


def test_fp16_under_a_pipeline_matches_one_process(corpus_cache: str) -> None:
    common = {"batch_size": 8, "max_steps": 8, "config": PIPELINED, "cache_dir": corpus_cache, "sgd_lr": 0.25}
    one = run_distributed(train_tiny_gpt, "auto", devices=1, precision="16-mixed", world_size=1, **common)[0]
    pp2 = run_distributed(train_tiny_gpt, "pp2", devices=2, precision="16-mixed", world_size=2, **common)[0]
    # The schedule scales each microbatch loss by the scaler's scale. Measured 1.1e-5 over 8 SGD steps; with the
    # loss left unscaled inside the schedule (gradients 65536x too small) the weights barely move: 0.45.
    assert relative_difference(pp2, one) <= 1e-4


class PlantInfOnOneRank(pl.Callback):
    """After backward of optimizer step ``step``, one rank (``rank``) writes inf into one of its gradients; every
    rank records whether each step changed its parameters and the loss scale after it."""

    def __init__(self, *, step: int, rank: int) -> None:
        self.step, self.rank = step, rank
        self.before: list[Tensor] = []
        self.moved: list[bool] = []
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before = [p.detach().clone() for p in _local_params(module)]

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            _local(grad).view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        after = _local_params(module)
        self.moved.append(any(not torch.equal(a.detach(), b) for a, b in zip(after, self.before, strict=True)))
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_params(module: pl.LightningModule) -> list[Tensor]:
    return [_local(p) for p in module.parameters()]


def _fit_with_an_inf_on_one_rank(strategy: str, cache_dir: str) -> tuple[list[bool], list[float]]:
    planted = PlantInfOnOneRank(step=2, rank=1)
    train_tiny_gpt(
        strategy,
        devices=2,
        batch_size=8,
        max_steps=4,
        config=PIPELINED,
        cache_dir=cache_dir,
        sgd_lr=0.25,
        precision="16-mixed",
        extra_callbacks=[planted],
    )
    return planted.moved, planted.scales


@pytest.mark.parametrize("strategy", ["pp2", "tp2"])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(strategy: str, corpus_cache: str) -> None:
    (moved0, scales0), (moved1, scales1) = run_distributed(
        _fit_with_an_inf_on_one_rank, strategy, corpus_cache, world_size=2
    )
    # Steps 0, 1 and 3 train on both ranks (each holds different weights: a stage, or a tensor-parallel shard);
    # step 2, whose gradient overflowed on rank 1 only, changes neither rank's weights and halves both scales.
    assert moved0 == moved1 == [True, True, False, True]
    assert scales0 == scales1 and scales0[2] == scales0[1] / 2


def test_bf16_mixed_under_a_pipeline_matches_one_process(corpus_cache: str) -> None:
    common = {"batch_size": 8, "max_steps": 8, "config": PIPELINED, "cache_dir": corpus_cache, "sgd_lr": 0.25}
    one = run_distributed(train_tiny_gpt, "auto", devices=1, precision="bf16-mixed", world_size=1, **common)[0]
    pp2 = run_distributed(train_tiny_gpt, "pp2", devices=2, precision="bf16-mixed", world_size=2, **common)[0]
    # Both autocast per op; the pipeline splits the batch in two microbatches, so sums round differently in bf16:
    # each rounding within one bf16 ulp, 2**-8 = 3.9e-3 relative; the bound is 1.3 such ulps of the loss.
    assert relative_difference(pp2, one) <= 5e-3


def _partial_batches(samples: int) -> DataLoader:
    tokens = torch.randint(0, PIPELINED.vocab_size, (samples, PIPELINED.block_size + 1), generator=_seeded())
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _trainer(strategy: str, devices: int, **kwargs: Any) -> pl.Trainer:
    return lightscale.Trainer(
        **kwargs,
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _fit_with_a_partial_last_batch() -> tuple[int, list[str]]:
    pl.seed_everything(0, verbose=False)
    # Lightning's sampler left out (dp=1: nothing to shard): a partial batch reaches the pipeline. With it, lightscale's
    # ExactlyOnceSampler drops the remainder before (tests/distributed/test_data_once.py).
    trainer = _trainer("pp2", 2, use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SGDGPTModule(PIPELINED), _partial_batches(20))  # batches of 8, 8 and 4
    return trainer.global_step, [str(w.message) for w in caught if "parallel_3d drops" in str(w.message)]


def test_a_partial_last_training_batch_is_dropped_with_a_warning_not_a_crash() -> None:
    (steps, warned), _ = run_distributed(_fit_with_a_partial_last_batch, world_size=2)
    # The 4 samples would split into 2 microbatches, but torch's stages run the shape of their first step: the
    # batch is dropped, with a warning naming both sizes, instead of running on mis-shaped receive buffers.
    assert steps == 2
    assert warned and "training batch of 4 samples" in warned[0] and "batches of 8" in warned[0]


class PredictingGPT(SGDGPTModule):
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])


def _evaluate_partial_batches(schedule: str | None) -> tuple[float, Tensor]:
    pl.seed_everything(0, verbose=False)
    module = PredictingGPT(PIPELINED)
    trainer = _trainer(Parallel3DStrategy(pp=2, schedule=schedule) if schedule else "auto", 2 if schedule else 1)
    # 21 samples: batches of 8, 8 and 5 (5 does not split into 2 microbatches).
    metric = trainer.validate(module, _partial_batches(21), verbose=False)[0]["val/loss"]
    return metric, torch.cat(trainer.predict(module, _partial_batches(21)))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_evaluation_counts_a_partial_last_batch_as_one_process_does(schedule: str) -> None:
    (metric, predicted), _ = run_distributed(_evaluate_partial_batches, schedule, world_size=2)
    one_metric, one_predicted = run_distributed(_evaluate_partial_batches, None, world_size=1)[0]
    # The 5 are padded to 8 and the padding's outputs cut off before the loss (zbv, whose forward-only schedule
    # torch cannot run, evaluates stage by stage on the whole batch instead).
    assert metric == pytest.approx(one_metric, rel=1e-6)
    torch.testing.assert_close(predicted, one_predicted, rtol=1e-5, atol=1e-5)


def test_fp16_under_tensor_parallel_matches_one_process_and_skips_steps_together(corpus_cache: str) -> None:
    common = {"batch_size": 8, "max_steps": 8, "cache_dir": corpus_cache, "sgd_lr": 0.25, "precision": "16-mixed"}
    one = run_distributed(train_tiny_gpt, "auto", devices=1, world_size=1, **common)[0]
    tp2 = run_distributed(train_tiny_gpt, "tp2", devices=2, world_size=2, **common)[0]
    # fp16 autocast on both sides, tp's split products rounded at other points: one fp16 ulp is 2**-11 = 4.9e-4
    # relative; the bound is 10 such ulps of the loss (loss scaling is exact: powers of two).
    assert relative_difference(tp2, one) <= 5e-3
