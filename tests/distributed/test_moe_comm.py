"""Exact all-to-all traffic of expert parallelism, from the counts the router made; load balancing by bias."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from helpers import SGD_LR, TINY, train_tiny_gpt
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from lightscale.layers.moe import MoE, MoEConfig, load_imbalance, moe_layers
from lightscale.parallel.experts import apply_expert_parallel
from lightscale.testing import run_distributed


class AllToAllCounter(TorchDispatchMode):
    """Elements each all-to-all sends from this rank, by dtype (tokens travel as floats, counts as int64)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.sent[args[0].dtype] = self.sent.get(args[0].dtype, 0) + args[0].numel()
        return func(*args, **(kwargs or {}))


def _one_microbatch(capacity_factor: float | None) -> tuple[int, int, int]:
    dim = 16
    torch.manual_seed(0)
    layer = MoE(dim, MoEConfig(n_experts=4, top_k=2, capacity_factor=capacity_factor))
    apply_expert_parallel([layer], init_device_mesh("cpu", (2,)))
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(3, 8, dim, requires_grad=True)
    with AllToAllCounter() as counter:
        layer(x).square().sum().backward()
    kept = int(layer.counts.sum()) - layer.dropped  # token copies this rank dispatched
    return counter.sent.get(torch.float32, 0), kept * dim, layer.config.n_experts


def test_all_to_all_elements_per_layer_and_microbatch() -> None:
    for capacity_factor in (None, 1.0):
        ranks = run_distributed(_one_microbatch, capacity_factor, world_size=2)
        sent = sum(rank[0] for rank in ranks)
        dispatched = sum(rank[1] for rank in ranks)
        # dispatch + combine forward, their two reverses in backward: 4 x (copies x hidden), over all ranks.
        assert sent == 4 * dispatched


class Loads(pl.Callback):
    """Tokens per expert of every step and MoE layer."""

    def __init__(self) -> None:
        self.counts: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.counts.append(torch.stack([layer.counts for layer in moe_layers(pl_module)]))

    def imbalance(self, steps: slice) -> float:
        """max/mean tokens per expert over ``steps`` (summed: one step's 512 copies are too few to measure 1.2)."""
        return max(load_imbalance(layer) for layer in sum(self.counts[steps]))


def test_bias_balancing_reaches_balance_within_50_steps(corpus_cache: str) -> None:
    # The tiny MoE GPT's router collapses onto one expert within a few steps of plain SGD (max/mean 2.0: the
    # expert is in every token's top 2); the bias must undo it while the router keeps learning.
    moe = MoEConfig(n_experts=4, top_k=2, score="sigmoid", balance="bias", bias_update_rate=0.003)
    loads = Loads()
    train_tiny_gpt(
        "auto",
        devices=1,
        batch_size=8,
        max_steps=50,
        sgd_lr=SGD_LR,
        config=dataclasses.replace(TINY, moe=moe),
        cache_dir=corpus_cache,
        extra_callbacks=[loads],
    )
    assert loads.imbalance(slice(5, 10)) > 1.8
    assert loads.imbalance(slice(45, 50)) <= 1.2
