"""ZeRO++ on FSDP2 (lightscale/parallel/fsdp_wires.py) on 2 and 4 gloo ranks: a tiny MLP trained with SGD + momentum.

What is checked, each against something that can fail:
* quantization off (and hpZ alone, which moves full-precision values) is bitwise plain FSDP2;
* each gathered weight is within one quantization step of the true one (``absmax / 127`` per 256-value block,
  stochastic rounding) and each reduced gradient within the sum of the ranks' steps over the world size: the int8
  error, element by element; training then stays within a bound derived from it (below), and dropping the scales
  fails that bound;
* bytes per step, exact from the collective counter: all-gather = int8 values + one fp32 scale per 256 values, the
  gradients an all-to-all of the same (int4: half the values' bytes) and no reduce-scatter left;
* hpZ on 2 x 2 ranks (two simulated nodes of two ranks): backward's all-gathers never span the two nodes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.parallel import fsdp_wires
from lightscale.parallel.fsdp_wires import QuantizedAllGather, QuantizedReduceScatter, ZeroPPOptions, apply_zeropp
from lightscale.testing import run_distributed

WIDTH, IN, OUT, BLOCKS = 64, 16, 16, 2
GLOBAL_BATCH, STEPS, LR, MOMENTUM = 8, 8, 0.05, 0.9
# Unit sizes (no biases): each block 2 x 64 x 64, the root 16 x 64 + 64 x 16; every rank's shard a multiple of 256
# values at 2 and 4 ranks, so the byte ratios below are exact: (1 + 4/256) / 4 of fp32, (1 + 4/256) / 2 of bf16.
BLOCK_NUMEL, ROOT_NUMEL = 2 * WIDTH * WIDTH, 2 * IN * WIDTH
INT8_VS_FP32 = (1 + 4 / 256) / 4  # 0.25390625
INT8_VS_BF16 = (1 + 4 / 256) / 2  # 0.5078125
INT4_VS_FP32 = (0.5 + 4 / 256) / 4  # 0.12890625
# Loss bound: int8 stochastic rounding moves a weight by less than one step, absmax/127 of its block: a relative error
# of at most 1/127 (the block's largest entry), and the summed gradients as much. The losses of 8 steps stay within that
# relative error of one process's.
LOSS_BOUND = 1 / 127


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH, bias=False)
        self.down = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(WIDTH, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(GLOBAL_BATCH, IN, generator=generator), torch.randn(GLOBAL_BATCH, OUT, generator=generator))
        for _ in range(STEPS)
    ]


def _shard(model: Tiny, options: ZeroPPOptions, *, bf16: bool = False) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    secondary = options.secondary_shard if isinstance(options.secondary_shard, int) else True
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=secondary, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy or MixedPrecisionPolicy())
    apply_zeropp(model, mesh, options)


def _train(options: ZeroPPOptions | None, *, bf16: bool = False) -> dict[str, Any]:
    """Train STEPS steps; return the global loss per step, the final full weights and the traffic of the last step."""
    torch.manual_seed(0)
    model = Tiny()
    distributed = dist.is_initialized()
    if distributed:
        _shard(model, options or ZeroPPOptions(), bf16=bf16)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    losses, forward, backward = [], CollectiveCounter(), CollectiveCounter()
    for x, y in _batches():
        local = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        forward.reset(), backward.reset()
        with forward:
            loss = nn.functional.mse_loss(model(x[local]), y[local])
        with backward:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if distributed:
            dist.all_reduce(loss := loss.detach().clone())
            loss /= world
        losses.append(loss.item())
    weights = {name: p.full_tensor() if distributed else p.detach() for name, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "forward": forward.calls, "backward": backward.calls}


def _run(ranks: int, options: ZeroPPOptions | None, **kwargs: Any) -> dict[str, Any]:
    return run_distributed(_train, options, world_size=ranks, timeout_s=300, **kwargs)[0]


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _bytes(calls: list[Any], kind: str) -> int:
    return sum(call.bytes for call in calls if call.kind == kind)


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _train(None)


@pytest.fixture(scope="module")
def plain_fsdp2() -> dict[str, Any]:
    return _run(2, None)


# ---- exactness when quantization is off --------------------------------------------------------------------
def test_plain_fsdp2_matches_one_process(plain_fsdp2: dict[str, Any], one_process: dict[str, Any]) -> None:
    assert _relative(plain_fsdp2["losses"], one_process["losses"]) <= 1e-5  # fp32 sums reassociated


def test_quantization_off_is_plain_fsdp2_bitwise(plain_fsdp2: dict[str, Any]) -> None:
    off = _run(2, ZeroPPOptions())
    assert off["losses"] == plain_fsdp2["losses"]
    assert all(torch.equal(off["weights"][n], w) for n, w in plain_fsdp2["weights"].items())


def test_secondary_shards_alone_are_plain_fsdp2_bitwise() -> None:
    # hpZ regathers in backward from shards of the values forward used: the same numbers over fewer ranks.
    plain, secondary = _run(4, None), _run(4, ZeroPPOptions(secondary_shard=2))
    assert secondary["losses"] == plain["losses"]
    assert all(torch.equal(secondary["weights"][n], w) for n, w in plain["weights"].items())


# ---- the int8 error, element by element, and training within its bound ---------------------------------------
def _quantized_collectives(bits: int) -> dict[str, float]:
    """The largest error of a quantized all-gather and reduce-scatter over their bound (<= 1 passes)."""
    world, rank, numel = dist.get_world_size(), dist.get_rank(), 1000  # not a multiple of 256: a partial last block
    generator = torch.Generator().manual_seed(rank)
    shard = torch.randn(numel, generator=generator) * (1 + torch.arange(numel) % 7)  # blocks of unequal ranges
    gathered = torch.empty(world * numel)
    QuantizedAllGather(dist.group.WORLD, bits=8)(gathered, shard.clone(), dist.group.WORLD)
    exact = torch.empty(world * numel)
    dist.all_gather_into_tensor(exact, shard)
    gather_bound = _steps(exact.view(world, numel), 8).view(-1)
    grads = torch.randn(world * numel, generator=generator)
    reduced = torch.empty(numel)
    QuantizedReduceScatter(bits)(reduced, grads.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    exact_sum, bound = torch.empty(numel), _steps(grads.view(world, numel), bits)
    dist.reduce_scatter_tensor(exact_sum, grads, op=dist.ReduceOp.SUM)
    dist.all_reduce(bound)  # every rank's rounding of the rows rank r owns
    return {
        "gather": ((gathered - exact).abs() / gather_bound).max().item(),
        "reduce": ((reduced - exact_sum / world).abs() / (bound.view(world, numel)[rank] / world)).max().item(),
    }


def _steps(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """One quantization step of every element's block: ``absmax / (2^(bits-1) - 1)`` (plus fp32 slack)."""
    count, numel = rows.shape
    padded = nn.functional.pad(rows, (0, -numel % 256)).view(count, -1, 256)
    step = padded.abs().amax(dim=-1, keepdim=True) / (2 ** (bits - 1) - 1)
    return (step.expand_as(padded).reshape(count, -1)[:, :numel] * (1 + 1e-5)).contiguous()


@pytest.mark.parametrize("bits", [8, 4])
def test_each_value_within_one_quantization_step(bits: int) -> None:
    for errors in run_distributed(_quantized_collectives, bits, world_size=2):
        assert errors["gather"] <= 1 and errors["reduce"] <= 1, errors


@pytest.mark.parametrize("ranks", [2, 4])
def test_int8_training_within_the_quantization_bound(ranks: int, one_process: dict[str, Any]) -> None:
    quantized = _run(ranks, ZeroPPOptions(weights="int8", gradients="int8"))
    difference = _relative(quantized["losses"], one_process["losses"])
    assert 0 < difference <= LOSS_BOUND, difference


def test_dropped_scales_fail_the_bound(monkeypatch: pytest.MonkeyPatch, one_process: dict[str, Any]) -> None:
    original = fsdp_wires.dequantize_rows

    def without_scales(wire: torch.Tensor, numel: int, bits: int, segments: Any = None) -> torch.Tensor:
        payload, wire = math.ceil(numel * bits / 8), wire.clone()  # every scale read as 1.0: the raw integers
        wire[:, payload:] = torch.ones(wire.shape[0], (wire.shape[1] - payload) // 4).view(torch.uint8)
        return original(wire, numel, bits, segments)

    monkeypatch.setattr(fsdp_wires, "dequantize_rows", without_scales)
    broken = _run(2, ZeroPPOptions(weights="int8", gradients="int8"))
    assert not _relative(broken["losses"], one_process["losses"]) <= LOSS_BOUND  # measured: losses ~1e11


# ---- exact bytes -------------------------------------------------------------------------------------------
def _expected(world: int, numel_per_rank: int, bits: int) -> int:
    return world * (math.ceil(numel_per_rank * bits / 8) + 4 * math.ceil(numel_per_rank / 256))


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_gather_bytes_are_int8_values_and_scales(ranks: int) -> None:
    plain, quantized = _run(ranks, None), _run(ranks, ZeroPPOptions(weights="int8"))
    units = [ROOT_NUMEL] + [BLOCK_NUMEL] * BLOCKS  # forward gathers the root, then each block
    assert _bytes(quantized["forward"], "all_gather") == sum(_expected(ranks, n // ranks, 8) for n in units)
    assert _bytes(plain["forward"], "all_gather") == 4 * sum(units)
    assert _bytes(quantized["forward"], "all_gather") / _bytes(plain["forward"], "all_gather") == INT8_VS_FP32
    assert _bytes(quantized["backward"], "all_gather") == sum(_expected(ranks, n // ranks, 8) for n in units[1:])


def test_all_gather_bytes_against_bf16() -> None:
    plain, quantized = _run(2, None, bf16=True), _run(2, ZeroPPOptions(weights="int8"), bf16=True)
    assert _bytes(quantized["forward"], "all_gather") / _bytes(plain["forward"], "all_gather") == INT8_VS_BF16


@pytest.mark.parametrize(("wire", "bits", "ratio"), [("int8", 8, INT8_VS_FP32), ("int4", 4, INT4_VS_FP32)])
def test_gradient_bytes(wire: str, bits: int, ratio: float) -> None:
    ranks = 2
    plain, quantized = _run(ranks, None), _run(ranks, ZeroPPOptions(gradients=wire))  # type: ignore[arg-type]
    units = [BLOCK_NUMEL] * BLOCKS + [ROOT_NUMEL]
    assert _bytes(plain["backward"], "reduce_scatter") == 4 * sum(units)  # fp32 gradients
    assert _bytes(quantized["backward"], "reduce_scatter") == 0  # the quantized sum runs as an all-to-all
    sent = _bytes(quantized["backward"], "all_to_all")
    assert sent == sum(_expected(ranks, n // ranks, bits) for n in units)
    assert sent / _bytes(plain["backward"], "reduce_scatter") == ratio


# ---- hpZ: backward stays inside each node ---------------------------------------------------------------------
def _crosses_nodes(call: Any, ranks_per_node: int = 2) -> bool:
    return len({rank // ranks_per_node for rank in call.ranks}) > 1


@pytest.mark.parametrize("secondary", [None, 2], ids=["no_hpz", "hpz"])
def test_secondary_shards_keep_backward_gathers_inside_nodes(secondary: int | None) -> None:
    run = _run(4, ZeroPPOptions(weights="int8", gradients="int8", secondary_shard=secondary))
    gathers = [call for call in run["backward"] if call.kind == "all_gather"]
    assert len(gathers) == BLOCKS and all(call.ranks for call in gathers)
    crossing = sum(call.bytes for call in gathers if _crosses_nodes(call))
    if secondary is None:
        assert crossing == sum(_expected(4, BLOCK_NUMEL // 4, 8) for _ in range(BLOCKS))
    else:  # inside each node, values already dequantized in forward: fp32 over 2 ranks
        assert crossing == 0
        assert sum(call.bytes for call in gathers) == 4 * BLOCK_NUMEL * BLOCKS
    assert _bytes(run["forward"], "all_gather") == _expected(4, ROOT_NUMEL // 4, 8) + BLOCKS * _expected(
        4, BLOCK_NUMEL // 4, 8
    )


# ---- hpZ's memory: the estimator counts the secondary shards exactly ----------------------------------------------
def _secondary_shard_bytes() -> int:
    """Bytes FSDP2 keeps between forward and backward for the tiny GPT's blocks under hpZ (2 of 4 ranks), bf16."""
    from helpers import TINY

    from lightscale.recipes.gpt import GPT

    torch.manual_seed(0)
    model = GPT(TINY)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = list(model.layers.values())
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=2, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    model(torch.randint(0, TINY.vocab_size, (2, TINY.block_size)))
    # torch's own record of what it kept (FSDPParam.to_sharded_post_forward): private, read by this test only.
    kept = [
        p._sharded_post_forward_param_data for u in units for p in u._get_fsdp_state()._fsdp_param_group.fsdp_params
    ]
    return sum(t.numel() * t.element_size() for t in kept)


def test_estimator_counts_secondary_shards_exactly() -> None:
    from helpers import TINY

    from lightscale.estimate import estimate_memory
    from lightscale.recipes.gpt import GPTModule
    from lightscale.strategies import FSDP2Strategy

    measured = run_distributed(_secondary_shard_bytes, world_size=4)

    def parameters(strategy: FSDP2Strategy) -> float:
        estimate = estimate_memory(GPTModule(TINY), strategy, world_size=4, precision="bf16-mixed", activations=False)
        return estimate.parameters.device

    extra = parameters(FSDP2Strategy(secondary_shard=2)) - parameters(FSDP2Strategy())
    assert extra == measured[0] == measured[3] > 0
