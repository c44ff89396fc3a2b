"""Expert parallelism reproduces one process step by step (fp32, plain SGD), with the same routing decisions.

The single-process run trains the same MoE GPT on the whole global batch; ``ep2`` splits the batch over two ranks
that exchange tokens by all-to-all. Expert 3 is shut out by its router bias, so it receives zero tokens on every
rank (the empty-split paths of dispatch, compute and combine all run) unless the router balances by aux loss.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import SGD_LR, TINY, relative_difference, train_tiny_gpt

from lightscale.layers.moe import MoEConfig, local, moe_layers
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import RankFailed, run_distributed

TOLERANCE = 1e-5
STEPS = 10
GLOBAL_BATCH = 8
MOE = {
    "dropless": MoEConfig(n_experts=4, top_k=2, balance="bias"),
    "capacity": MoEConfig(n_experts=4, top_k=2, capacity_factor=1.0, balance="bias", z_loss_coef=1e-3),
    "aux_loss": MoEConfig(n_experts=4, top_k=1, capacity_factor=1.5, balance="aux_loss", score="sigmoid"),
}


class RoutingRecorder(pl.Callback):
    """Shuts out the last expert (bias -100), then records every step's per-expert counts (over all microbatches)
    and the last microbatch's drops, summed over all ranks (each rank routes its own tokens)."""

    def __init__(self) -> None:
        self.counts: list[list[list[float]]] = []
        self.dropped: list[int] = []
        self.bytes: dict[str, int] = {}
        self.stepped = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        layers = moe_layers(pl_module)
        for layer in layers:
            layer.router.expert_bias[-1] = -100.0
        experts = {id(p) for layer in layers for p in layer.experts.parameters()}
        for kind, inside in (("experts", True), ("dense", False)):
            params = [p for p in pl_module.parameters() if (id(p) in experts) == inside]
            self.bytes[kind] = sum(local(p).numel() * p.element_size() for p in params)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        # Before the module's hook moves the biases: ``load`` holds this step's counts (all microbatches).
        slots = pl_module.moe_slots()  # every MoE layer of the model; None where another pipeline stage holds it
        counts = torch.stack([torch.zeros(4) if layer is None else layer.load.clone() for layer in slots])
        dropped = torch.tensor([float(sum(layer.dropped for layer in slots if layer is not None))])
        if dist.is_initialized():
            dist.all_reduce(counts)
            dist.all_reduce(dropped)
        self.counts.append(counts.tolist())
        self.dropped.append(int(dropped))
        self.stepped = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.stepped:  # after an optimizer step, not after an accumulation micro-step
            for layer in moe_layers(pl_module):
                layer.load.zero_()  # the bias update did (balance: bias); the other modes never use it
            self.stepped = False


def _train_recording(
    strategy: Any, devices: int, config: Any, cache_dir: str, *, data_shards: int | None = None
) -> dict[str, Any]:
    recorder = RoutingRecorder()
    losses = train_tiny_gpt(
        strategy,
        devices=devices,
        batch_size=GLOBAL_BATCH // (data_shards or devices),
        max_steps=STEPS,
        config=config,
        cache_dir=cache_dir,
        sgd_lr=SGD_LR,
        local_losses=True,
        extra_callbacks=[recorder],
    )
    return {"losses": losses, "counts": recorder.counts, "dropped": recorder.dropped, "bytes": recorder.bytes}


PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)


@cache
def _reference(mode: str, cache_dir: str, pipelined: bool = False) -> dict[str, Any]:
    config = dataclasses.replace(PIPELINED if pipelined else TINY, moe=MOE[mode])
    return run_distributed(_train_recording, "auto", 1, config, cache_dir, world_size=1)[0]


def _fit_ep(strategy: Any, mode: str, cache_dir: str, ranks: int = 2, pp: int = 1, tp: int = 1) -> dict[str, Any]:
    config = dataclasses.replace(PIPELINED if pp > 1 else TINY, moe=MOE[mode])
    shards = ranks // pp // tp
    runs = run_distributed(
        _train_recording, strategy, ranks, config, cache_dir, data_shards=shards, world_size=ranks, timeout_s=600
    )
    losses = [sum(step) / ranks for step in zip(*(run["losses"] for run in runs), strict=True)]
    return {
        "losses": losses,
        "counts": runs[0]["counts"],
        "dropped": runs[0]["dropped"],
        "bytes": [run["bytes"] for run in runs],
    }


@pytest.mark.parametrize(("name", "mode"), [("ep2", mode) for mode in MOE] + [("fsdp2", "dropless")])
def test_ep2_matches_one_process(name: str, mode: str, corpus_cache: str) -> None:
    # fsdp2: the same MoE with its experts sharded by FSDP2 like any weight (built on the meta device).
    reference = _reference(mode, corpus_cache)
    ep = _fit_ep(name, mode, corpus_cache)
    assert ep["counts"] == reference["counts"]  # the same routing decisions, every step and layer
    shut_out = all(layer[-1] == 0 for step in ep["counts"] for layer in step)
    assert shut_out == (MOE[mode].balance == "bias")  # expert 3 got no token on any rank
    assert ep["dropped"] == reference["dropped"]
    assert (max(ep["dropped"]) > 0) == (MOE[mode].capacity_factor is not None)
    assert relative_difference(ep["losses"], reference["losses"]) <= TOLERANCE
    assert reference["losses"][-1] < reference["losses"][0] - 1.0  # it learned: the comparison is not vacuous
    _check_bytes(ep["bytes"], reference["bytes"], ep=2 if name == "ep2" else 1, dp_shard=1 if name == "ep2" else 2)


def _check_bytes(per_rank: list[dict[str, int]], whole: dict[str, int], *, ep: int, dp_shard: int) -> None:
    """Expert bytes per rank are exactly the total / (ep x dp_shard); the dense part is split by FSDP2 over all
    ranks (dim-0 shards: the ranks' bytes add up to the total)."""
    assert all(rank["experts"] * ep * dp_shard == whole["experts"] for rank in per_rank)
    assert sum(rank["dense"] for rank in per_rank) == whole["dense"]
    assert max(rank["dense"] for rank in per_rank) < whole["dense"] / len(per_rank) * 1.1


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_ep2_dp2_matches_one_process(mode: str, corpus_cache: str) -> None:
    # 4 ranks: experts sharded over ep=2 and by FSDP2 over the dp_shard=2 ranks holding the same experts.
    reference = _reference(mode, corpus_cache)
    ep = _fit_ep(Parallel3DStrategy(dp=2, ep=2), mode, corpus_cache, ranks=4)
    assert ep["counts"] == reference["counts"] and ep["dropped"] == reference["dropped"]
    assert relative_difference(ep["losses"], reference["losses"]) <= TOLERANCE
    _check_bytes(ep["bytes"], reference["bytes"], ep=2, dp_shard=2)


def test_ep2_pp2_matches_one_process(corpus_cache: str) -> None:
    # 4 ranks: 2 pipeline stages (1f1b, 2 microbatches), each stage's experts sharded over ep=2.
    reference = _reference("dropless", corpus_cache, pipelined=True)
    ep = _fit_ep("ep2_pp2", "dropless", corpus_cache, ranks=4, pp=2)
    assert ep["counts"] == reference["counts"]
    assert relative_difference(ep["losses"], reference["losses"]) <= TOLERANCE


def test_ep2_tp2_matches_one_process(corpus_cache: str) -> None:
    # 4 ranks: attention tensor parallel over tp=2 (sequence parallel), the MoE layers whole on both tp ranks with
    # their experts sharded over ep=2; the two tp ranks of a batch route the same tokens (counted twice here).
    reference = _reference("capacity", corpus_cache)
    ep = _fit_ep("ep2_tp2", "capacity", corpus_cache, ranks=4, tp=2)
    assert ep["counts"] == [[[2 * c for c in layer] for layer in step] for step in reference["counts"]]
    assert relative_difference(ep["losses"], reference["losses"]) <= TOLERANCE


class UnscaledExpertGradients(Parallel3DStrategy):
    """ep2 that forgets the 1/ep of the expert gradients (each arrives summed over the ep ranks' losses)."""

    def apply_parallelism(self, module: Any) -> Any:
        wrapped = super().apply_parallelism(module)
        for layer in moe_layers(module):
            for param in layer.experts.parameters():
                param.register_hook(lambda grad: grad * 2)
        return wrapped


def test_zero_refuses_moe(corpus_cache: str) -> None:
    config = dataclasses.replace(TINY, moe=MOE["dropless"])
    with pytest.raises(RankFailed, match="'ep2'"):
        run_distributed(_train_recording, "zero2", 2, config, corpus_cache, world_size=2)


def test_a_planted_scale_error_fails(corpus_cache: str) -> None:
    reference = _reference("dropless", corpus_cache)
    ep = _fit_ep(UnscaledExpertGradients(ep=2), "dropless", corpus_cache)
    assert relative_difference(ep["losses"], reference["losses"]) > 100 * TOLERANCE


def test_ep2_matches_one_process_with_adamw(corpus_cache: str) -> None:
    # The recipe's AdamW and warmup-cosine schedule: optimizer state of DTensor experts and FSDP2 shards alike.
    config = dataclasses.replace(TINY, moe=MOE["capacity"])
    common = {"max_steps": STEPS, "config": config, "cache_dir": corpus_cache}
    reference = run_distributed(train_tiny_gpt, "auto", devices=1, batch_size=8, world_size=1, **common)[0]
    ep = run_distributed(train_tiny_gpt, "ep2", devices=2, batch_size=4, world_size=2, **common)[0]
    assert relative_difference(ep, reference) <= TOLERANCE


def test_ep2_clipping_uses_the_global_norm(corpus_cache: str) -> None:
    # The norm spans the dense shards and every rank's experts: a norm over one rank's experts would clip differently.
    config = dataclasses.replace(TINY, moe=MOE["dropless"])
    common = {"max_steps": STEPS, "config": config, "cache_dir": corpus_cache, "sgd_lr": SGD_LR}
    clipped = {**common, "gradient_clip_val": 0.5}
    reference = run_distributed(train_tiny_gpt, "auto", devices=1, batch_size=8, world_size=1, **clipped)[0]
    unclipped = run_distributed(train_tiny_gpt, "auto", devices=1, batch_size=8, world_size=1, **common)[0]
    assert relative_difference(unclipped, reference) > 100 * TOLERANCE  # the clip is active
    ep = run_distributed(train_tiny_gpt, "ep2", devices=2, batch_size=4, world_size=2, **clipped)[0]
    assert relative_difference(ep, reference) <= TOLERANCE


def test_ep2_with_accumulation_and_checkpointing_matches(corpus_cache: str) -> None:
    # 2 micro-batches per step (the bias moves once, from their summed load) and the dispatch recomputed in
    # backward under full activation checkpointing.
    reference = _reference("dropless", corpus_cache)
    config = dataclasses.replace(TINY, moe=MOE["dropless"])
    strategy = Parallel3DStrategy(ep=2, activation_checkpointing="full")
    common = {"max_steps": STEPS, "config": config, "cache_dir": corpus_cache, "sgd_lr": SGD_LR}
    common |= {"extra_callbacks": [RoutingRecorder()]}  # the same shut-out expert as the reference
    ep = run_distributed(train_tiny_gpt, strategy, devices=2, batch_size=2, accumulate=2, world_size=2, **common)[0]
    assert relative_difference(ep, reference["losses"]) <= TOLERANCE
