"""The single-device MoE layer: routing, dropping, balancing and FLOPs (one process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from lightscale.errors import ConfigurationError
from lightscale.layers.moe import MoE, MoEConfig, capacity_mask, update_router_biases
from lightscale.parallel.experts import check_expert_parallel, expert_major_order
from lightscale.parallel.mesh import ParallelDims
from lightscale.recipes.gpt import GPTConfig
from lightscale.recipes.gpt.model import flops_per_token
from lightscale.recipes.gpt.parallelize import gpt_tp_plan, validate_gpt_moe, validate_gpt_plan


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="top_k=3 exceeds n_experts=2"):
        MoEConfig(n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="balance must be one of"):
        MoEConfig(balance="loss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEConfig(capacity_factor=0.0)
    assert [MoEConfig(moe_every=2).is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the gate-weighted sum of its chosen experts' outputs."""
    flat = x.reshape(-1, x.shape[-1])
    _, _, experts, weights = layer.router(flat)
    w1, w2 = layer.experts.w1, layer.experts.w2
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for e, w in zip(experts[n].tolist(), weights[n], strict=True):
            out[n] += w * (F.gelu(flat[n] @ w1[e]) @ w2[e])
    return out.view_as(x)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_dropless_layer_equals_token_by_token_experts(score: str) -> None:
    torch.manual_seed(0)
    layer = MoE(8, MoEConfig(n_experts=4, top_k=2, score=score))
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(layer(x), _reference(layer, x))
    assert layer.counts.sum() == 2 * 5 * 2 and layer.dropped == 0


def test_capacity_admits_first_choices_first_then_positions() -> None:
    # One sequence of 3 tokens, top 2; expert 0 holds 2 copies: tokens 0 and 1 as first choices. Token 2's first
    # choice (0) is dropped although token 0's second choice (1) was routed later in slot order.
    experts = torch.tensor([[[0, 1], [0, 2], [0, 1]]])
    keep = capacity_mask(experts, n_experts=4, capacity=2)
    assert keep.tolist() == [[[True, True], [True, True], [False, True]]]


def test_capacity_mode_drops_copies_and_counts_them() -> None:
    torch.manual_seed(0)
    config = MoEConfig(n_experts=4, top_k=2, capacity_factor=0.5)
    layer = MoE(8, config)
    layer(torch.randn(3, 8, 8))
    assert config.capacity(8) == 2
    assert layer.dropped >= 3 * 8 * 2 - 3 * 4 * 2  # at most capacity x experts copies kept per sequence


def test_aux_loss_is_its_floor_for_uniform_probabilities() -> None:
    # E * sum_e f_e * P_e with P_e = 1/E is sum_e f_e = 1, whatever the choices: the coefficient itself.
    layer = MoE(8, MoEConfig(n_experts=4, top_k=2, balance="aux_loss", aux_loss_coef=0.01))
    torch.nn.init.zeros_(layer.router.weight)
    layer(torch.randn(2, 6, 8))
    assert layer.aux_loss.item() == pytest.approx(0.01)


def test_bias_moves_against_the_load_once_per_step_whatever_the_accumulation() -> None:
    torch.manual_seed(0)
    layer = MoE(8, MoEConfig(n_experts=4, top_k=1, balance="bias", bias_update_rate=0.1))
    x = torch.randn(4, 6, 8)
    layer(x[:2])
    layer(x[2:])  # two micro-batches: the load is the sum, as one batch of 4 would give
    split_load = layer.load.clone()
    layer.load.zero_()
    layer(x)
    assert torch.equal(layer.load, split_load)
    update_router_biases([layer], n_experts=4)
    expected = 0.1 * torch.sign(split_load.mean() - split_load)
    assert torch.equal(layer.router.expert_bias, expected) and layer.load.sum() == 0


def test_flops_count_active_experts_only() -> None:
    dense = GPTConfig(n_layer=2, n_head=2, n_embd=32)
    one = dataclasses.replace(dense, moe=MoEConfig(n_experts=1, top_k=1))
    many = dataclasses.replace(dense, moe=MoEConfig(n_experts=8, top_k=1))
    # One active expert of the dense MLP's shape per token: only the router (32 x E per layer) is extra.
    assert flops_per_token(many) - flops_per_token(one) == 6 * 2 * 32 * 7


def test_expert_major_order_regroups_received_copies() -> None:
    counts = torch.tensor([[1, 2], [3, 0]])  # from source 0: 1 copy for expert 0, 2 for expert 1; source 1: 3, 0
    # Received rows: s0e0=[0], s0e1=[1, 2], s1e0=[3, 4, 5]; by expert: e0 <- [0, 3, 4, 5], e1 <- [1, 2].
    assert expert_major_order(counts).tolist() == [0, 3, 4, 5, 1, 2]


def test_expert_parallel_validation() -> None:
    with pytest.raises(ConfigurationError, match=r"no lightscale\.layers\.moe\.MoE layer"):
        check_expert_parallel([], 2)
    with pytest.raises(ConfigurationError, match=r"does not divide \[6\]"):
        check_expert_parallel([MoE(8, MoEConfig(n_experts=6))], 4)
    with pytest.raises(ConfigurationError, match="balance: bias"):
        validate_gpt_moe(GPTConfig(moe=MoEConfig(balance="aux_loss")), tp=1, num_stages=2)


@pytest.mark.parametrize("moe_every", [1, 2])
def test_tp_plan_names_dense_and_moe_layers(moe_every: int) -> None:
    config = GPTConfig(n_layer=2, moe=MoEConfig(moe_every=moe_every))
    validate_gpt_plan(config, sequence_parallel=True, loss_parallel=True)  # every pattern matches a module
    plan = gpt_tp_plan(config=config)
    assert isinstance(plan["layers.1.feed_forward"], PrepareModuleInputOutput)  # the MoE layer runs whole
    assert ("layers.0.feed_forward.w1" in plan) == (moe_every == 2)


def test_expert_parallel_ranks_have_their_own_data() -> None:
    dims = ParallelDims(world_size=8, dp_shard=2, ep=2, tp=2)
    assert dims.data_shards == 4 and dims.dp == 2


def test_aux_loss_falls_to_its_floor_from_a_router_that_favours_one_expert() -> None:
    torch.manual_seed(0)
    layer = MoE(16, MoEConfig(n_experts=4, top_k=2, balance="aux_loss", aux_loss_coef=1.0))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 0.1  # inputs have mean 1: expert 0 is every token's first choice
    optimizer = torch.optim.Adam(layer.router.parameters(), lr=0.01)
    losses = []
    for _ in range(60):
        layer(torch.randn(8, 16, 16) + 1.0)
        optimizer.zero_grad()
        layer.aux_loss.backward()
        optimizer.step()
        losses.append(layer.aux_loss.item())
    assert losses[0] > 1.4  # E * sum f * P well above the floor of 1 (the coefficient)
    assert max(losses[-10:]) < 1.02  # within the sampling noise of f on 128 tokens
