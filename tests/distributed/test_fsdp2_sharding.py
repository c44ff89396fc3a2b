"""FSDP2 shards exactly: per-rank model-state bytes are 1/N of the full model, and gradient accumulation over k
micro-steps reduce-scatters once per FSDP unit per optimizer step, not k times."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, train_tiny_gpt

from lightscale.callbacks import CommMonitor
from lightscale.callbacks.measured_state import model_state_bytes
from lightscale.testing import run_distributed

UNITS = TINY.n_layer + 1  # one FSDP unit per transformer block, plus the root (embeddings, final norm)


class StateBytes(pl.Callback):
    """After the first optimizer step: this rank's bytes and the full (unsharded) bytes of the same state."""

    def __init__(self) -> None:
        self.local: dict[str, int] = {}
        self.full: dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.local:
            return
        local = model_state_bytes(pl_module, trainer.optimizers)
        self.local = {"parameters": local.parameters, "gradients": local.gradients, "optimizer": local.optimizer}
        params = list(pl_module.parameters())
        full_param_bytes = sum(p.numel() * p.element_size() for p in params)  # DTensor numel is the global one
        states = [s for opt in trainer.optimizers for s in opt.state.values()]
        full_optimizer = sum(
            (v.numel() * v.element_size()) for state in states for v in state.values() if isinstance(v, torch.Tensor)
        )
        self.full = {"parameters": full_param_bytes, "gradients": full_param_bytes, "optimizer": full_optimizer}


def _state_bytes(strategy: str, cache_dir: str) -> dict[str, Any]:
    probe = StateBytes()
    train_tiny_gpt(
        strategy, devices=dist.get_world_size(), batch_size=2, max_steps=1, cache_dir=cache_dir, extra_callbacks=[probe]
    )
    return {"local": probe.local, "full": probe.full}


@pytest.mark.parametrize(("strategy", "ranks", "shards"), [("fsdp2", 2, 2), ("fsdp2_offload", 2, 2), ("hsdp", 4, 2)])
def test_each_rank_holds_one_shard_of_everything(strategy: str, ranks: int, shards: int, corpus_cache: str) -> None:
    for seen in run_distributed(_state_bytes, strategy, corpus_cache, world_size=ranks, timeout_s=300):
        for kind in ("parameters", "gradients", "optimizer"):
            ratio = seen["local"][kind] * shards / seen["full"][kind]
            assert ratio == pytest.approx(1.0, abs=0.01), (kind, seen)


def _count_collectives(strategy: str, accumulate: int, cache_dir: str) -> list[dict[str, int]]:
    counter = CommMonitor(every_n_steps=1)
    train_tiny_gpt(
        strategy,
        devices=dist.get_world_size(),
        batch_size=1,
        max_steps=3,
        accumulate=accumulate,
        cache_dir=cache_dir,
        extra_callbacks=[counter],
    )
    return [{kind: traffic.calls for kind, traffic in step.items()} for step in counter.records]


@pytest.mark.parametrize(("strategy", "ranks"), [("fsdp2", 2), ("fsdp2_grad_op", 2), ("hsdp", 4)])
def test_accumulation_reduce_scatters_once_per_unit_per_step(strategy: str, ranks: int, corpus_cache: str) -> None:
    k = 4
    per_step = run_distributed(_count_collectives, strategy, k, corpus_cache, world_size=ranks, timeout_s=300)[0]
    assert len(per_step) == 3
    for counts in per_step:
        assert counts["reduce_scatter"] == UNITS  # not k * UNITS: micro-steps keep gradients local
        # Every micro-step gathers every unit in forward; full shard re-gathers the blocks in backward too.
        regather = TINY.n_layer if strategy != "fsdp2_grad_op" else 0
        assert counts["all_gather"] == k * (UNITS + regather)


def _fit_briefly(strategy: object, cache_dir: str) -> list[float]:
    return train_tiny_gpt(strategy, devices=dist.get_world_size(), batch_size=2, max_steps=1, cache_dir=cache_dir)


def test_unknown_unit_class_fails_before_training(corpus_cache: str) -> None:
    from lightscale.strategies import FSDP2Strategy
    from lightscale.testing import RankFailed

    with pytest.raises(RankFailed, match=r"ConfigurationError: FSDP unit class 'Block' does not occur in"):
        run_distributed(_fit_briefly, FSDP2Strategy(unit_classes=["Block"]), corpus_cache, world_size=2)


def test_hsdp_degrees_not_matching_the_world_fail_before_training(corpus_cache: str) -> None:
    from lightscale.strategies import FSDP2Strategy
    from lightscale.testing import RankFailed

    with pytest.raises(RankFailed, match=r"ConfigurationError: Parallel degrees dp_replicate=2 x dp_shard=2 multiply"):
        run_distributed(_fit_briefly, FSDP2Strategy(dp_replicate=2, dp_shard=2), corpus_cache, world_size=2)
