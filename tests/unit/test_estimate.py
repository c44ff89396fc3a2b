"""The estimator reproduces the published figures exactly and agrees with a measured forward of the GPT recipe."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from lightscale.cli import main
from lightscale.estimate import (
    PerParameter,
    bytes_per_parameter,
    estimate_memory,
    layout_of,
    megatron_activation_bytes,
    zero_stage_bytes,
)
from lightscale.estimate.optimizer_state import adafactor_state_bytes
from lightscale.estimate.report import parse_bytes
from lightscale.recipes.gpt import GPTConfig, GPTModule

SMALL = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)


def test_zero_paper_figure_1() -> None:
    # Rajbhandari et al. 2019, Figure 1: Ψ = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    psi, n = 7_500_000_000, 64
    figures = [round(zero_stage_bytes(psi, world_size=n, stage=stage) / 1e9, 1) for stage in range(4)]
    assert figures == [120.0, 31.4, 16.6, 1.9]
    assert zero_stage_bytes(psi, world_size=n, stage=1) == 2 * psi + 2 * psi + 12 * psi / n  # to the byte


def test_sixteen_bytes_per_parameter_for_mixed_precision_adam() -> None:
    per = bytes_per_parameter("bf16-mixed", engine="deepspeed")
    assert per == PerParameter(parameters=2, gradients=2, optimizer=12) and per.total == 16
    assert zero_stage_bytes(1_500_000_000, world_size=1, stage=0) == 24e9  # GPT-2 1.5B needs 24 GB (ZeRO, sec. 3.1)
    assert bytes_per_parameter("32-true", engine="torch") == PerParameter(4, 4, 8)  # the parameters are the master


def test_megatron_activation_formulas() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B, Korthikanti et al. 2022, Table 2's terms
    sbh = s * b * h
    assert megatron_activation_bytes(s=s, b=b, h=h, a=a, layers=1) == sbh * (34 + 5 * a * s / h)
    assert megatron_activation_bytes(s=s, b=b, h=h, a=a, layers=1, tp=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    sp = megatron_activation_bytes(s=s, b=b, h=h, a=a, layers=1, tp=t, sequence_parallel=True)
    assert sp == sbh * (34 + 5 * a * s / h) / t
    assert (
        megatron_activation_bytes(s=s, b=b, h=h, a=a, layers=1, tp=t, sequence_parallel=True, recompute="selective")
        == sbh * 34 / t
    )
    assert megatron_activation_bytes(s=s, b=b, h=h, a=a, layers=1, recompute="full") == 2 * sbh


class Undeclared(GPTModule):
    """The GPT recipe without its transformer shape: the estimator measures a one-sample forward instead."""

    transformer_shape = None


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_formula_matches_a_measured_forward(checkpointing: str) -> None:
    batch = (torch.zeros(4, 64, dtype=torch.long), torch.ones(4, 64, dtype=torch.long))
    kwargs = {"world_size": 1, "micro_batch": 4, "activation_checkpointing": checkpointing}
    formula = estimate_memory(GPTModule(SMALL), "fsdp2", **kwargs)
    measured = estimate_memory(Undeclared(SMALL), "fsdp2", batch=batch, **kwargs)
    assert formula.activation_source != measured.activation_source
    assert formula.activations.device == pytest.approx(measured.activations.device, rel=0.05)
    assert formula.model_states == measured.model_states


def test_model_states_per_strategy_on_many_ranks() -> None:
    module = GPTModule(SMALL)
    psi = 2 * 12 * 32 * 32 + 256 * 32 + 64 * 32 + 5 * 32  # blocks, tied token table, positions, norms
    ddp = estimate_memory(module, "bucketed_ddp", world_size=1024)
    assert ddp.num_params == psi and ddp.parameters.device == 4 * psi and ddp.optimizer.device == 8 * psi
    fsdp = estimate_memory(module, "fsdp2", world_size=4)
    assert fsdp.model_states == pytest.approx(16 * psi / 4, rel=0.01)
    offload = estimate_memory(module, "fsdp2_offload", world_size=4)
    assert offload.parameters.device == offload.optimizer.device == 0 and offload.host_total > 0
    zero2 = estimate_memory(module, "zero2", world_size=8, precision="bf16-mixed")
    assert zero2.model_states == pytest.approx(2 * psi + 14 * psi / 8, rel=0.01)


def test_tensor_and_pipeline_splits() -> None:
    untied = dataclasses.replace(SMALL, tie_weights=False)
    full = estimate_memory(GPTModule(untied), "bucketed_ddp", world_size=1)
    tp = estimate_memory(GPTModule(untied), "tp2", world_size=2)
    pp = estimate_memory(GPTModule(untied), "pp2", world_size=2)
    norms = 5 * 32  # replicated under TP (SequenceParallel keeps them whole)
    assert tp.rank_params == (full.rank_params - norms) / 2 + norms
    assert full.rank_params / 2 < pp.rank_params < full.rank_params
    assert tp.activations.device < full.activations.device


@pytest.mark.parametrize(("ep", "dp"), [(2, 1), (2, 2), (4, 1)])
def test_expert_parallel_splits_experts_over_ep_and_shards_the_dense_part_over_dp_x_ep(ep: int, dp: int) -> None:
    from lightscale.layers.moe import MoEConfig
    from lightscale.strategies import Parallel3DStrategy

    module = GPTModule(dataclasses.replace(SMALL, moe=MoEConfig(n_experts=4, top_k=2)))
    module.configure_model()
    experts = sum(p.numel() for name, p in module.named_parameters() if ".experts." in name)
    dense = sum(p.numel() for p in module.parameters()) - experts
    estimate = estimate_memory(module, Parallel3DStrategy(ep=ep, dp=dp), world_size=ep * dp)
    assert estimate.rank_params == dense + experts / ep  # before data-parallel sharding
    # fp32 parameters: experts / (ep x dp_shard) (FSDP over the inner dp), dense / (dp x ep) (FSDP over all)
    assert estimate.parameters.device == pytest.approx(4 * (experts / (ep * dp) + dense / (dp * ep)), rel=1e-3)


def test_seven_billion_parameters_estimate_quickly() -> None:
    config = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, tie_weights=False)
    start = time.perf_counter()
    est = estimate_memory(GPTModule(config), "zero3", world_size=1024, precision="bf16-mixed")
    assert time.perf_counter() - start < 10
    assert 6.5e9 < est.num_params < 7e9


def test_unknown_strategy_names_the_closest() -> None:
    with pytest.raises(ValueError, match="zero3"):
        layout_of("zer03", world_size=2)


def test_cli_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    main(["estimate", "--config", "gpt/tiny_ddp.yaml", "--world-size", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and out["strategy"] == "bucketed_ddp"
    categories = ("parameters", "gradients", "optimizer", "activations")
    assert out["device_total"] == pytest.approx(sum(out[c]["device"] for c in categories))


def test_sizes_parse() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("40 GB") == 40e9


@pytest.mark.parametrize(
    ("settings", "extra"),
    [({}, 8), ({"mode": "local_sgd"}, 4), ({"outer_momentum": 0.0}, 4), ({"compression": "int8"}, 12)],
)
def test_diloco_counts_its_outer_state_exactly(settings: dict, extra: int) -> None:
    from lightscale.parallel.diloco import OuterSync
    from lightscale.strategies import DiLoCoStrategy

    module = GPTModule(SMALL)
    ddp = estimate_memory(module, "bucketed_ddp", world_size=4)
    diloco = estimate_memory(module, DiLoCoStrategy(**settings), world_size=4)
    psi = ddp.num_params
    assert diloco.optimizer.device - ddp.optimizer.device == extra * psi  # fp32 global copy, momentum, residual
    assert (diloco.parameters, diloco.gradients) == (ddp.parameters, ddp.gradients)
    fsdp = estimate_memory(module, "fsdp2", world_size=2)
    inside = estimate_memory(module, DiLoCoStrategy(workers=2, inner="fsdp2", **settings), world_size=4)
    assert inside.optimizer.device - fsdp.optimizer.device == extra * fsdp.parameters.device / 4  # sharded alike
    if "compression" in settings:
        return
    # What OuterSync really holds after a round (one worker: the mean is its own payload).
    strategy = DiLoCoStrategy(**settings)
    module.configure_model()
    sync = OuterSync(
        module.named_parameters(),
        sync_every=1,
        mode=strategy.mode,
        reduce=lambda payload: payload,
        outer_optimizer=strategy._outer_optimizer if strategy.mode == "diloco" else None,
    )
    sync.after_inner_step(1)
    states = [s for f in sync.fragments if f.optimizer for st in f.optimizer.state.values() for s in st.values()]
    held = sum(t.nbytes for _, t in sync.named_globals()) + sum(s.nbytes for s in states if s.dim())
    assert held == extra * psi


def test_adafactor_factored_state_as_torch_stores_it() -> None:
    """torch.optim.Adafactor: row factor shape[:-1], column factor shape[:-2] + shape[-1:], vectors a full variance,
    a float32 step each; FSDP2's dimension-0 chunks split the row factor (and a 3-D tensor's column factor), not a
    matrix's column factor. Measured equal in tests/distributed/test_sharded_adafactor.py."""

    shapes = [torch.Size((15, 8)), torch.Size((15,)), torch.Size((3, 4, 6))]
    whole = (15 + 8) + 15 + (3 * 4 + 3 * 6)
    assert adafactor_state_bytes(shapes, dp_shard=1, dtype_bytes=4) == 4 * whole + 4 * 3
    halves = (8 + 8) + 8 + (2 * 4 + 2 * 6)  # the most loaded rank holds ceil(rows / 2)
    assert adafactor_state_bytes(shapes, dp_shard=2, dtype_bytes=4) == 4 * halves + 4 * 3
    with pytest.raises(ValueError, match="ZeRO refuses Adafactor"):
        estimate_memory(
            torch.nn.Linear(4, 4), "zero2", world_size=2, optimizer=torch.optim.Adafactor, activations=False
        )
