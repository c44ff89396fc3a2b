"""parallel_3d at its edges: precision under a pipeline, and a last batch that does not split into microbatches."""

from __future__ import annotations

import dataclasses
import warnings

import lightning.pytorch as pl
import pytest
import torch
from helpers import TINY, SGDGPTModule, relative_difference, train_tiny_gpt
from torch.utils.data import DataLoader, TensorDataset

import lightscale
from lightscale.testing import RankFailed, run_distributed

PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)


def test_fp16_under_a_pipeline_is_refused_before_training(corpus_cache: str) -> None:
    with pytest.raises(RankFailed, match=r"precision='16-mixed' with pipeline parallelism \(pp > 1\) is refused"):
        run_distributed(
            train_tiny_gpt,
            "pp2",
            devices=2,
            batch_size=8,
            max_steps=2,
            config=PIPELINED,
            cache_dir=corpus_cache,
            precision="16-mixed",
            world_size=2,
        )


def test_bf16_mixed_under_a_pipeline_matches_one_process(corpus_cache: str) -> None:
    common = {"batch_size": 8, "max_steps": 8, "config": PIPELINED, "cache_dir": corpus_cache, "sgd_lr": 0.25}
    one = run_distributed(train_tiny_gpt, "auto", devices=1, precision="bf16-mixed", world_size=1, **common)[0]
    pp2 = run_distributed(train_tiny_gpt, "pp2", devices=2, precision="bf16-mixed", world_size=2, **common)[0]
    # Both autocast per op; the pipeline splits the batch in two microbatches, so sums round differently in bf16.
    assert relative_difference(pp2, one) <= 5e-3


def _fit_with_partial_last_batch() -> tuple[int, list[str]]:
    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(0, PIPELINED.vocab_size, (21, PIPELINED.block_size + 1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])  # 21 samples: batches of 8, 8 and 5
    trainer = lightscale.Trainer(
        strategy="pp2",
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SGDGPTModule(PIPELINED), DataLoader(data, batch_size=8))
    return trainer.global_step, [str(w.message) for w in caught if "parallel_3d drops" in str(w.message)]


def test_a_partial_last_batch_is_dropped_with_a_warning_not_a_crash() -> None:
    (steps, warned), _ = run_distributed(_fit_with_partial_last_batch, world_size=2)
    assert steps == 2  # the two full batches trained; the 5-sample batch cannot split into 2 microbatches
    assert warned and "batch of 5 samples" in warned[0] and "microbatches=2" in warned[0]


def test_fp16_under_tensor_parallel_matches_one_process_and_skips_steps_together(corpus_cache: str) -> None:
    common = {"batch_size": 8, "max_steps": 8, "cache_dir": corpus_cache, "sgd_lr": 0.25, "precision": "16-mixed"}
    one = run_distributed(train_tiny_gpt, "auto", devices=1, world_size=1, **common)[0]
    tp2 = run_distributed(train_tiny_gpt, "tp2", devices=2, world_size=2, **common)[0]
    assert relative_difference(tp2, one) <= 5e-3


def _found_inf_decisions() -> list[float]:
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = ShardedGradScaler(device="cpu")
    scaler.scale(param.sum()).backward()
    if dist.get_rank() == 1:
        param.grad[0] = float("inf")  # an overflow on one rank only
    scaler.step(optimizer)
    scaler.update()
    return [float(param.detach()[1]), scaler.get_scale()]


def test_the_loss_scaler_skips_a_step_on_every_rank_when_one_overflows() -> None:
    # The scaler parallel_3d uses for 16-mixed without FSDP: its found-inf is all-reduced, so no rank steps alone.
    (w0, scale0), (w1, scale1) = run_distributed(_found_inf_decisions, world_size=2)
    assert w0 == w1 == 1.0  # neither rank stepped
    assert scale0 == scale1 < 65536.0  # both backed off the scale
