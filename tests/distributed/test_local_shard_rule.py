"""The one local-shard rule (lightscale/strategies/shards.py), under every registered name with its defaults.

After the strategy's setup, for each parameter: ``local_shard`` is this rank's piece of the one-process parameter (a
DTensor's local tensor, a ZeRO-3 flat slice, or the whole), and the pieces of all ranks reassemble it; a value written
through the piece, then ``after_local_write``, reads back, and every tensor the rank stores for the parameter
(``parameter_tensors``: a ZeRO-3 persistent parameter's whole copy too) holds it. This is what an EMA and the
measured-state callback rely on (the zero3 EMA crash was a rule that disagreed with DeepSpeed's persistence).

Skipped: names needing 4 ranks (tp2_pp2, ep2_pp2, ep2_tp2, cp2_tp2: tp x pp, ep x pp, ep x tp, cp x tp need 4) and
zero_infinity without libaio (its NVMe swap; the CPU offload rule is zero3_offload's, tested here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
from functools import cache
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, quiet_trainer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import lightscale
from lightscale.layers.moe import MoEConfig
from lightscale.recipes.gpt import GPTDataModule, GPTModule
from lightscale.strategies import ZeroStrategy
from lightscale.strategies.deepspeed.shards import ZeroShards
from lightscale.strategies.shards import TensorShards
from lightscale.testing import run_distributed

FOUR_RANKS = {"tp2_pp2", "ep2_pp2", "ep2_tp2", "cp2_tp2"}
NAMES = [name for name, _ in lightscale.strategy_table() if name not in FOUR_RANKS]
PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
MOE = dataclasses.replace(TINY, moe=MoEConfig(n_experts=4, top_k=2, balance="bias"))
SEED = 1234
# What DeepSpeed imports while it builds an engine (its optimizer check imports its Muon module).
WARM = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer")


def _config(name: str) -> Any:
    return PIPELINED if name == "pp2" else MOE if name == "ep2" else TINY


@cache
def _one_process(name: str) -> dict[str, torch.Tensor]:
    """The parameters one process starts from (every strategy starts from them: tests/distributed/test_parity.py)."""
    pl.seed_everything(SEED, verbose=False)
    module = GPTModule(_config(name))
    pl.seed_everything(SEED, verbose=False)  # the strategy's setup_environment re-seeds before configure_model
    module.configure_model()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _piece(rules: TensorShards, param: torch.Tensor, whole: torch.Tensor) -> tuple[str, Any]:
    """Where this rank's piece of ``param`` lies in ``whole``: a DTensor's box, a flat slice, or everything."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(whole.shape, param.device_mesh, param.placements)
        return "box", (tuple(shape), tuple(offset))
    if rules.is_flat_slice(param):
        size = math.ceil(whole.numel() / dist.get_world_size())
        return "flat", (dist.get_rank() * size, size)
    return "whole", None


def _cut(whole: torch.Tensor, where: tuple[str, Any]) -> torch.Tensor:
    kind, at = where
    if kind == "box":
        shape, offset = at
        return whole[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
    if kind == "flat":
        start, size = at
        return whole.reshape(-1)[start : start + size]
    return whole


def _reassemble(shape: torch.Size, pieces: list[tuple[tuple[str, Any], torch.Tensor]]) -> torch.Tensor | None:
    """Every rank's piece put in its place in a NaN tensor of the whole shape (a ZeRO-3 slice's padding dropped);
    None if a piece is too small for its place."""
    whole = torch.full(shape, float("nan"))
    for where, piece in pieces:
        target = _cut(whole, where)
        if piece.numel() < target.numel():
            return None
        target.copy_(piece.reshape(-1)[: target.numel()].reshape(target.shape))
    return whole


class CheckRule(pl.Callback):
    """At the start of training (the strategy's setup done): the rule's checks, per parameter, as strings."""

    def __init__(self, expected: dict[str, torch.Tensor]) -> None:
        self.expected, self.failures, self.checked = expected, [], 0

    @torch.no_grad()
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.should_stop = True  # the checks need the strategy's setup only, not a step
        rules = trainer.strategy.tensor_shards
        assert isinstance(rules, TensorShards)
        params = [(name, p) for name, p in pl_module.named_parameters() if name in self.expected]
        self._check(rules, params, self.expected, "as set up")
        if self.failures:
            return  # a write through a wrong piece would only crash (the zero3 EMA's "size of tensor a (0)")
        written = {name: 2 * t + 1 for name, t in self.expected.items()}  # each rank writes its piece of it
        for name, param in params:
            shard = rules.local_shard(param)
            where = _piece(rules, param, written[name])
            piece = _cut(written[name], where).reshape(-1)
            shard.reshape(-1)[: piece.numel()].copy_(piece)
        rules.after_local_write(pl_module)
        self._check(rules, params, written, "written")
        for name, param in params:  # every copy the rank stores of a parameter holds the written value
            whole = written[name]
            for stored in rules.parameter_tensors(param):
                if stored.numel() == whole.numel() and not torch.equal(stored.reshape(whole.shape).cpu(), whole):
                    self.failures.append(f"{name}: a whole copy this rank stores is stale after after_local_write")

    def _check(self, rules: TensorShards, params: list, expected: dict[str, torch.Tensor], when: str) -> None:
        mine = []
        for name, param in params:
            whole = expected[name]
            shard = rules.local_shard(param)
            where = _piece(rules, param, whole)
            if tuple(rules.global_shape(param)) != tuple(whole.shape):
                self.failures.append(f"{name}: global_shape {tuple(rules.global_shape(param))} != {tuple(whole.shape)}")
            want = _cut(whole, where)
            got = shard.detach().cpu().reshape(-1)[: want.numel()]
            if got.numel() != want.numel() or not torch.equal(got, want.reshape(-1)):
                self.failures.append(f"{name} ({when}): local_shard is not this rank's {where[0]} piece")
            mine.append((name, where, shard.detach().cpu().clone()))
            self.checked += 1
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        by_name: dict[str, list] = {}
        for rank_pieces in gathered:
            for name, where, piece in rank_pieces:
                by_name.setdefault(name, []).append((where, piece))
        for name, pieces in by_name.items():
            whole = _reassemble(expected[name].shape, pieces)
            if whole is None or not torch.equal(whole, expected[name]):
                self.failures.append(f"{name} ({when}): the ranks' pieces do not reassemble the parameter")


def _run(strategy: Any, name: str, cache_dir: str, root: str) -> dict[str, Any]:
    config = _config(name)
    expected = _one_process(name)
    check = CheckRule(expected)
    pl.seed_everything(SEED, verbose=False)
    module = GPTModule(config)
    data = GPTDataModule(block_size=config.block_size, batch_size=2, cache_dir=cache_dir)
    trainer = quiet_trainer(strategy, devices=2, max_steps=1, callbacks=[check], default_root_dir=root)
    trainer.fit(module, data)
    return {"failures": check.failures, "checked": check.checked, "expected": len(expected)}


def _async_io_available() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


@pytest.mark.parametrize("name", NAMES)
def test_local_shard_rule_under_every_name(name: str, corpus_cache: str, tmp_path: Any) -> None:
    if name == "zero_infinity" and not _async_io_available():
        pytest.skip("zero_infinity needs libaio (apt-get install libaio-dev) for its NVMe swap")
    if name in ZeroStrategy.aliases:  # imported once, here: every forked rank inherits them (~3 s each otherwise)
        for module in WARM:
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
    results = run_distributed(_run, name, name, corpus_cache, str(tmp_path), world_size=2, timeout_s=300)
    for rank, result in enumerate(results):
        assert result["failures"] == [], (rank, result["failures"][:5])
        assert result["checked"] > 0  # the comparison is not vacuous: the rank held parameters of the model
    if name != "pp2":  # a pipeline rank holds its own stages only; every other rank holds a piece of each parameter
        assert all(result["checked"] == 2 * result["expected"] for result in results)


class WholeShards(ZeroShards):
    """The planted error: ZeRO-3's answers giving a parameter's local shard as the parameter itself."""

    def local_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        return TensorShards.local_shard(self, tensor)


class WholeZero3(ZeroStrategy):
    tensor_shards = WholeShards()


def test_a_planted_wrong_rule_fails(corpus_cache: str, tmp_path: Any) -> None:
    results = run_distributed(_run, WholeZero3(stage=3), "zero3", corpus_cache, str(tmp_path), world_size=2)
    assert all(any("local_shard is not this rank's flat piece" in f for f in result["failures"]) for result in results)
