"""parallel_3d costs, counted exactly: parameter bytes per rank, TP collectives per layer, pipeline sends per step."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import TINY, train_tiny_gpt

from lightscale.callbacks import CommMonitor
from lightscale.callbacks.measured_state import model_state_bytes
from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.recipes.gpt import GPT
from lightscale.recipes.gpt.parallelize import parallelize_gpt
from lightscale.strategies import Parallel3DStrategy, ParallelDims
from lightscale.testing import run_distributed

PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.parameter_bytes = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.parameter_bytes = model_state_bytes(pl_module).parameters


def _parameter_bytes(cache_dir: str) -> int:
    record = _Record()
    strategy = Parallel3DStrategy(tp=2, pp=2)
    train_tiny_gpt(
        strategy, devices=4, batch_size=8, max_steps=1, config=PIPELINED, cache_dir=cache_dir, extra_callbacks=[record]
    )
    return record.parameter_bytes


def test_parameter_bytes_per_rank_tp2_pp2(corpus_cache: str) -> None:
    # The tiny GPT, 4 layers, untied, no biases, d=32, vocab 256, block 32, fp32:
    #   token table 256x32 = 8192, position table 32x32 = 1024, output head 256x32 = 8192, final norm 32;
    #   per layer: wq, wk, wv, wo 4 x 1024 + w1, w2 2 x 4096 = 12288 sharded + two norms 2 x 32 replicated.
    # Total 66,848 parameters; /(tp*pp) = 16,712. TP halves everything but the norms (replicated: SequenceParallel):
    #   stage 0 (tables, layers 0-1): (8192 + 1024 + 2 x 12288) / 2 + 2 x 64 = 17,024 params = 68,096 bytes;
    #   stage 1 (layers 2-3, norm, head): (2 x 12288 + 8192) / 2 + 2 x 64 + 32 = 16,544 params = 66,176 bytes.
    assert sum(p.numel() for p in GPT(PIPELINED).parameters()) == 66_848
    per_rank = run_distributed(_parameter_bytes, corpus_cache, world_size=4, timeout_s=300)
    assert per_rank == [68_096, 68_096, 66_176, 66_176]  # mesh (pp, tp): ranks 0, 1 hold stage 0


def _block_collectives(sequence_parallel: bool) -> tuple[dict, dict]:
    mesh = ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(TINY), mesh, sequence_parallel=sequence_parallel, loss_parallel=True)
    seq = TINY.block_size // (2 if sequence_parallel else 1)  # a block's input is sequence-sharded under SP
    x = torch.randn(2, seq, TINY.n_embd, requires_grad=True)
    with CollectiveCounter() as forward:
        out = model.layers["0"](x)
    with CollectiveCounter() as backward:
        out.sum().backward()
    return _calls(forward), _calls(backward)


def _calls(counter: CollectiveCounter) -> dict[str, int]:
    return {kind: traffic.calls for kind, traffic in counter.totals().items()}


def test_tensor_parallel_collectives_per_layer_match_megatron() -> None:
    # Megatron-LM (Shoeybi et al. 2019, fig. 4): 2 all-reduces per layer forward (after attention, after MLP) and
    # 2 backward (the inputs' gradients of the column-parallel wq/wk/wv and w1), per microbatch.
    forward, backward = run_distributed(_block_collectives, False, world_size=2)[0]
    assert forward == {"all_reduce": 2}
    assert backward == {"all_reduce": 2}
    # Sequence parallel (Korthikanti et al. 2022): each all-reduce becomes an all-gather + a reduce-scatter.
    forward, backward = run_distributed(_block_collectives, True, world_size=2)[0]
    assert forward == {"all_gather": 2, "reduce_scatter": 2}
    assert backward == {"all_gather": 2, "reduce_scatter": 2}


def _sends(schedule: str, microbatches: int, cache_dir: str) -> int:
    counter = CommMonitor(every_n_steps=1)
    strategy = Parallel3DStrategy(pp=2, schedule=schedule, microbatches=microbatches)
    train_tiny_gpt(
        strategy, devices=2, batch_size=8, max_steps=2, config=PIPELINED, cache_dir=cache_dir, extra_callbacks=[counter]
    )
    return counter.records[1]["send"].calls  # the second step: the first also infers shapes


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # One stage per rank: stage 0 sends an activation per microbatch, stage 1 a gradient per microbatch.
        ("gpipe", [4, 4]),
        ("1f1b", [4, 4]),
        # Looped placement, stages 0,2 | 1,3: every stage but the last sends activations, every one but the first
        # sends gradients, all across ranks: rank 0 sends 0->1, 2->3 forward and 2->1 backward = 3 x 4.
        ("interleaved_1f1b", [12, 12]),
        # V placement, stages 0,3 | 1,2: 1->2 forward and 2->1 backward stay on rank 1, so 2 x 4 each.
        ("zbv", [8, 8]),
    ],
)
def test_pipeline_sends_per_step_match_the_schedule(schedule: str, expected: list[int], corpus_cache: str) -> None:
    assert run_distributed(_sends, schedule, 4, corpus_cache, world_size=2, timeout_s=300) == expected
