"""``fsdp2_zeropp`` through the Trainer (tiny GPT, SGD, 2 and 4 gloo ranks): it learns as fsdp2 within the int8 bound,
its secondary shards run through the strategy, and its checkpoints hold the full-precision shards, never the wire.

The exact bytes and the element-wise error bounds are in test_zeropp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import SGD_LR, relative_difference, train_tiny_gpt
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightscale.checkpoint.convert import convert
from lightscale.strategies import FSDP2Strategy
from lightscale.testing import run_distributed

GLOBAL_BATCH, STEPS = 8, 10
# Stochastic rounding moves a value by less than one int8 step, 1/127 of its block's largest value (test_zeropp.py),
# blocks restarting at every parameter.
LOSS_BOUND = 1 / 127


class _Gather(pl.Callback):
    """The full fp32 weights at the end of training (gathered collectively, as the checkpoint was taken)."""

    def __init__(self) -> None:
        self.full: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.full.update(get_model_state_dict(pl_module.model, options=options))


def _train(strategy: Any, cache_dir: str, checkpoint: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    ranks, gather = dist.get_world_size(), _Gather()
    losses = train_tiny_gpt(
        strategy,
        devices=ranks,
        batch_size=GLOBAL_BATCH // ranks,
        cache_dir=cache_dir,
        max_steps=STEPS,
        sgd_lr=SGD_LR,
        stop_after=STEPS if checkpoint else None,
        save_checkpoint_to=checkpoint,
        extra_callbacks=[gather],
    )
    return losses, gather.full


def _run(strategy: Any, ranks: int, cache_dir: str, checkpoint: str | None = None) -> tuple[list[float], dict]:
    return run_distributed(_train, strategy, cache_dir, checkpoint, world_size=ranks, timeout_s=600)[0]


@pytest.fixture(scope="module")
def fsdp2_losses(corpus_cache: str) -> list[float]:
    return _run("fsdp2", 2, corpus_cache)[0]


def test_fsdp2_zeropp_learns_as_fsdp2_and_saves_full_precision(
    fsdp2_losses: list[float], corpus_cache: str, tmp_path: Path
) -> None:
    checkpoint = str(tmp_path / "zeropp.ckpt")
    losses, gathered = _run("fsdp2_zeropp", 2, corpus_cache, checkpoint)
    # Measured 3.5e-4 (3.1e-3 when blocks spanned parameters: a norm's weights set the step of a matrix's).
    assert 0 < relative_difference(losses, fsdp2_losses) <= LOSS_BOUND
    convert(checkpoint, tmp_path / "gpt.pt")
    exported = torch.load(tmp_path / "gpt.pt", weights_only=True)
    assert sorted(exported) == sorted(gathered)
    for name, tensor in gathered.items():  # the fp32 master shards: not int8, not dequantized values
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], tensor), name


def test_secondary_shards_through_the_strategy_change_no_value(corpus_cache: str) -> None:
    # hpZ alone moves full-precision values: 2 x 2 ranks train exactly as fsdp2 on 4 ranks.
    plain = _run("fsdp2", 4, corpus_cache)[0]
    secondary = _run(FSDP2Strategy(secondary_shard=2), 4, corpus_cache)[0]
    assert relative_difference(secondary, plain) == 0


@pytest.mark.parametrize(
    ("options", "ranks"),
    [({"activation_checkpointing": "full"}, 2), ({"dp_replicate": 2}, 4)],
    ids=["activation_checkpointing", "hsdp"],
)
def test_composes_with_checkpointing_and_hsdp(options: dict, ranks: int, corpus_cache: str) -> None:
    # Recomputed forwards gather the same int8 weights again; under HSDP the quantized all-to-all runs inside each
    # shard group and the fp32 all-reduce across the replicas.
    plain = _run(FSDP2Strategy(**options), ranks, corpus_cache)[0]
    quantized = _run(
        FSDP2Strategy(quantized_weights="int8", quantized_gradients="int8", **options), ranks, corpus_cache
    )
    assert 0 < relative_difference(quantized[0], plain) <= LOSS_BOUND


def _diloco(inner: FSDP2Strategy, cache_dir: str) -> tuple[list[float], dict[str, int]]:
    from lightscale.callbacks import CommMonitor
    from lightscale.strategies import DiLoCoStrategy

    monitor = CommMonitor(every_n_steps=1)
    strategy = DiLoCoStrategy(workers=2, sync_every=5, inner=inner)
    losses = train_tiny_gpt(
        strategy,
        devices=4,
        batch_size=2,
        cache_dir=cache_dir,
        max_steps=STEPS,
        sgd_lr=SGD_LR,
        extra_callbacks=[monitor],
    )
    return losses, {kind: traffic.bytes for kind, traffic in monitor.records[-1].items()}


def test_inside_diloco_workers(corpus_cache: str) -> None:
    # 2 workers x 2 ranks: each worker's FSDP2 sends the quantized wires over its own two ranks.
    plain, plain_bytes = run_distributed(_diloco, FSDP2Strategy(), corpus_cache, world_size=4, timeout_s=600)[0]
    inner = FSDP2Strategy(quantized_weights="int8", quantized_gradients="int8")
    quantized, quantized_bytes = run_distributed(_diloco, inner, corpus_cache, world_size=4, timeout_s=600)[0]
    assert 0 < relative_difference(quantized, plain) <= LOSS_BOUND
    assert "all_to_all" in quantized_bytes and "reduce_scatter" not in quantized_bytes
    assert quantized_bytes["all_gather"] < plain_bytes["all_gather"] / 3.9  # int8 + scales: ~0.254 of fp32
