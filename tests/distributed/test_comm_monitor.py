"""CommMonitor's per-step figures on 2 CPU ranks, against the data-parallel theory (Ψ = gradient bytes): DDP
moves exactly 2Ψ(N-1)/N per rank; FSDP2 reduce-scatters every gradient once and gathers every parameter in
forward and the blocks again in backward; DeepSpeed ZeRO-3 (nothing persistent) reduce-scatters Ψ and, the tiny
model staying within its live-parameter budget from forward to backward, gathers Ψ once from the second step on.
Tensor parallel: each layer adds Megatron's 4·b·s·h per microbatch. (The exact-count tests of bucketed_ddp, FSDP2
and parallel_3d count through the same CollectiveCounter.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from helpers import TINY, train_tiny_gpt

from lightscale.callbacks import CommMonitor
from lightscale.callbacks.comm import traffic_per_rank
from lightscale.recipes.gpt import GPT
from lightscale.strategies import Parallel3DStrategy, ZeroStrategy
from lightscale.testing import run_distributed

PSI = GPT(TINY).num_params()
LAYER = sum(p.numel() for p in GPT(TINY).layers["0"].parameters())
KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # DeepSpeed also broadcasts a few small tensors per step
NOTHING_PERSISTENT = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _records(strategy: Any, cache_dir: str) -> list[dict[str, tuple[int, int]]]:
    monitor = CommMonitor(every_n_steps=1)
    train_tiny_gpt(strategy, devices=2, batch_size=2, max_steps=3, cache_dir=cache_dir, extra_callbacks=[monitor])
    return [{kind: (t.calls, t.elements) for kind, t in step.items()} for step in monitor.records]


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("bucketed_ddp", {"all_reduce": (1, PSI)}),
        (
            "fsdp2",
            {"all_gather": (TINY.n_layer + 1 + TINY.n_layer, PSI + TINY.n_layer * LAYER), "reduce_scatter": (3, PSI)},
        ),
        (ZeroStrategy(stage=3, config=NOTHING_PERSISTENT), {"all_gather": (1, PSI), "reduce_scatter": (1, PSI)}),
    ],
    ids=["bucketed_ddp", "fsdp2", "zero3"],
)
def test_per_step_collectives(strategy: Any, expected: dict[str, tuple[int, int]], corpus_cache: str) -> None:
    for records in run_distributed(_records, strategy, corpus_cache, world_size=2, timeout_s=300):
        assert len(records) == 3
        data_parallel = [{kind: step[kind] for kind in KINDS if kind in step} for step in records[1:]]
        assert data_parallel == [expected] * 2  # from the second step: the first, DeepSpeed also traces the module


def test_ring_traffic_equals_ddp_theory() -> None:
    from lightscale.measure.comm_counter import Traffic

    grad_bytes = 4 * PSI
    for ranks in (2, 4, 8):
        assert (
            traffic_per_rank({"all_reduce": Traffic(1, PSI, grad_bytes)}, ranks) == 2 * grad_bytes * (ranks - 1) / ranks
        )


def _tp_step(layers: int, sequence_parallel: bool, cache_dir: str) -> dict[str, tuple[int, int]]:
    monitor = CommMonitor(every_n_steps=1)
    strategy = Parallel3DStrategy(tp=2, sequence_parallel=sequence_parallel)
    config = dataclasses.replace(TINY, n_layer=layers)
    train_tiny_gpt(
        strategy, devices=2, batch_size=2, max_steps=2, config=config, cache_dir=cache_dir, extra_callbacks=[monitor]
    )
    return {kind: (t.calls, t.elements) for kind, t in monitor.records[-1].items()}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_per_layer_is_megatrons_4bsh(sequence_parallel: bool, corpus_cache: str) -> None:
    # Two more layers add, per layer and microbatch, Megatron's 4 all-reduces of b·s·h elements (2 forward, 2
    # backward), or under sequence parallelism 4 all-gathers and 4 reduce-scatters of the same whole buffers.
    two = run_distributed(_tp_step, 2, sequence_parallel, corpus_cache, world_size=2)[0]
    four = run_distributed(_tp_step, 4, sequence_parallel, corpus_cache, world_size=2)[0]
    bsh = 2 * TINY.block_size * TINY.n_embd
    kinds = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
    assert set(two) == set(four) == set(kinds)
    for kind in kinds:
        assert four[kind][0] - two[kind][0] == 2 * 4
        assert four[kind][1] - two[kind][1] == 2 * 4 * bsh
