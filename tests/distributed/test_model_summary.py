"""The model summary lightscale.Trainer installs counts every parameter once under every strategy, and its FLOPs are
the module's declared ``flops_per_batch`` (Lightning's own prints 0 params under ZeRO-3 and 0 FLOPs)."""

from __future__ import annotations

from typing import Any

import torch
from helpers import TINY, train_tiny_gpt
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary

import lightscale
from lightscale.callbacks.model_summary import GlobalSummary, ModelSummary, global_numel, with_global_summary
from lightscale.recipes.gpt import GPTModule
from lightscale.testing import run_distributed

STRATEGIES = ("bucketed_ddp", "fsdp2", "zero3")  # fsdp2 builds the GPT on the meta device, zero3 partitions it


def _summaries(cache_dir: str) -> dict[str, tuple[int, int, int]]:
    seen: list[tuple[int, int, int]] = []

    def record(data: Any, total: int, trainable: int, size: float, modes: Any, total_flops: int, **kw: Any) -> None:
        seen.append((total, trainable, total_flops))

    ModelSummary.summarize = staticmethod(record)  # type: ignore[method-assign]  # forked rank: no one else sees it
    result = {}
    for name in STRATEGIES:
        train_tiny_gpt(name, devices=2, batch_size=4, max_steps=1, cache_dir=cache_dir, enable_model_summary=True)
        result[name] = seen[-1] if seen else (-1, -1, -1)
    return result


def _single_process() -> tuple[int, int]:
    module = GPTModule(TINY)
    module.configure_model()
    return sum(p.numel() for p in module.parameters()), module.flops_per_batch


def test_totals_equal_the_single_process_count_under_every_strategy(corpus_cache: str) -> None:
    params, flops = _single_process()
    per_rank = run_distributed(_summaries, corpus_cache, world_size=2, timeout_s=600)
    assert per_rank[0] == {name: (params, params, flops) for name in STRATEGIES}


def test_meta_and_lazy_parameters() -> None:
    with torch.device("meta"):
        layer = torch.nn.Linear(3, 4)
    assert sum(global_numel(p) for p in layer.parameters()) == 16
    assert global_numel(torch.nn.LazyLinear(4).weight) == 0


def test_trainer_installs_it_in_place_of_lightnings() -> None:
    trainer = lightscale.Trainer(accelerator="cpu", devices=1, logger=False)
    assert sum(type(cb) is ModelSummary for cb in trainer.callbacks) == 1
    assert not any(type(cb) is LightningModelSummary for cb in trainer.callbacks)
    deeper = with_global_summary([LightningModelSummary(max_depth=3)], enabled=True)
    assert [(type(cb), cb._max_depth) for cb in deeper] == [(ModelSummary, 3)]
    assert with_global_summary([], enabled=False) == []
    quiet = lightscale.Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False)
    assert not any(isinstance(cb, LightningModelSummary) for cb in quiet.callbacks)


def test_declared_flops_win_over_the_counter() -> None:
    module = GPTModule(TINY)
    module.configure_model()
    assert GlobalSummary(module).total_flops == module.flops_per_batch > 0
