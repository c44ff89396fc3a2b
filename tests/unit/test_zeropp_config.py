"""ZeRO++ options on the FSDP2 family: the registered name, bad values and conflicting options refused at construction
(or, for what only the layout or the Trainer knows, before any model work), and the quantizer's round trip."""

from __future__ import annotations

import math

import pytest
import torch

from lightscale.errors import ConfigurationError
from lightscale.parallel.zeropp import BLOCK, ZeroPPOptions, dequantize_rows, quantize_rows, wire_bytes
from lightscale.strategies import FSDP2Strategy


def test_fsdp2_zeropp_is_registered() -> None:
    import lightning

    import lightscale  # noqa: F401  (registers the names)

    strategy = lightning.Trainer(strategy="fsdp2_zeropp", accelerator="cpu", devices=2, logger=False).strategy
    assert isinstance(strategy, FSDP2Strategy)
    assert strategy.zeropp == ZeroPPOptions(weights="int8", gradients="int8", secondary_shard="node")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"quantized_weights": "int4"}, r"quantized_weights='int4' is not a ZeRO\+\+ wire.*'none', 'int8'"),
        ({"quantized_gradients": "fp8"}, r"quantized_gradients='fp8'.*'none', 'int8', 'int4'"),
        ({"secondary_shard": 1}, r"secondary_shard=1 is not a group size.*'node'"),
        ({"secondary_shard": True}, r"secondary_shard=True is not a group size"),
        ({"secondary_shard": 2, "reshard_after_forward": False}, r"reshard_after_forward=False.*Choose one"),
        ({"quantized_gradients": "int8", "compression": "bf16"}, r"compression='bf16' both choose the gradient wire"),
    ],
)
def test_bad_options_refused_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        FSDP2Strategy(**kwargs)


def test_secondary_shard_must_divide_dp_shard() -> None:
    strategy = FSDP2Strategy(secondary_shard=3)
    with pytest.raises(ConfigurationError, match=r"secondary_shard=3 must divide dp_shard=4.*valid here: \[2, 4\]"):
        strategy.parallel_dims(4)
    assert ZeroPPOptions(secondary_shard="node").secondary_group_size(dp_shard=4, per_node=8) == 4  # gcd


def test_float8_refused_with_zeropp() -> None:
    import lightscale
    from lightscale.plugins.fsdp_precision import Float8Precision

    float8 = Float8Precision("float8", "cpu", emulate=True)
    trainer = lightscale.Trainer(
        strategy=FSDP2Strategy(quantized_weights="int8"), plugins=[float8], accelerator="cpu", devices=2, logger=False
    )
    with pytest.raises(ConfigurationError, match=r"precision='float8' already all-gathers float8 weights"):
        trainer.strategy.check_before_launch(trainer)  # the launcher's first call, before any rank starts


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 255, 256, 1000])
def test_round_trip_within_half_a_step_and_exact_size(bits: int, numel: int) -> None:
    rows = torch.randn(3, numel) * torch.tensor([[1.0], [1e-3], [0.0]])  # an all-zero row stays zero
    wire = quantize_rows(rows, bits)
    assert wire.dtype == torch.uint8 and wire.shape == (3, wire_bytes(numel, bits))
    assert wire_bytes(numel, bits) == math.ceil(numel * bits / 8) + 4 * math.ceil(numel / BLOCK)
    back = dequantize_rows(wire, numel, bits)
    padded = torch.nn.functional.pad(rows, (0, -numel % BLOCK)).view(3, -1, BLOCK)
    half_step = (padded.abs().amax(-1, keepdim=True) / (2**bits - 2)).expand_as(padded).reshape(3, -1)[:, :numel]
    assert torch.all((back - rows).abs() <= half_step * (1 + 1e-6))
    assert torch.equal(back[2], rows[2])
