"""The simulated slow link charges each collective its ring traffic at the given bandwidth (exact arithmetic)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightscale.measure.comm_counter import SlowLink
from lightscale.testing import run_distributed


def _collectives() -> float:
    with SlowLink(bytes_per_second=1e6, ranks=2) as link:
        dist.all_reduce(torch.ones(1000))  # 4000 B buffer, 2 (n - 1) / n = 1 of it on the wire
        out = torch.empty(2000)
        dist.all_gather_into_tensor(out, torch.ones(1000))  # 8000 B gathered, half of it received from the other
    return link.seconds_waited


def test_each_collective_waits_its_ring_traffic() -> None:
    waited = run_distributed(_collectives, world_size=2, timeout_s=60)
    assert waited == [pytest.approx((4000 + 4000) / 1e6, rel=1e-12)] * 2


def test_bad_link_is_refused() -> None:
    with pytest.raises(ValueError, match="bytes_per_second > 0"):
        SlowLink(bytes_per_second=0, ranks=2)
