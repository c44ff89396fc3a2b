"""ZeRO-Infinity's parameter swap buffers are sized to the model, not DeepSpeed's 5 x 1e8 elements."""

from __future__ import annotations

from torch import nn

from lightscale.strategies.deepspeed.config import ZeroOptions, zero_section
from lightscale.strategies.deepspeed.partition import largest_parameter

INFINITY = ZeroOptions(stage=3, offload_optimizer=True, offload_params=True, nvme_path="/tmp/swap")


def test_the_buffers_hold_the_largest_parameter() -> None:
    model = nn.Sequential(nn.Linear(12, 7), nn.Linear(7, 1))
    section = zero_section(INFINITY, largest_parameter=largest_parameter(model))
    assert section["offload_param"]["buffer_size"] == 12 * 7


def test_host_offload_and_an_unknown_model_keep_deepspeeds_default() -> None:
    host = ZeroOptions(stage=3, offload_optimizer=True, offload_params=True)
    assert "buffer_size" not in zero_section(host, largest_parameter=84)["offload_param"]
    assert "buffer_size" not in zero_section(INFINITY)["offload_param"]  # deepspeed.zero.Init: not built yet
