"""OuterSync's bad-input errors (one process, a world of one) and the int8 codec's error bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightscale.errors import ConfigurationError
from lightscale.parallel.data_parallel import size_buckets
from lightscale.parallel.diloco import Codec, OuterSync, split_fragments


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # 4 tensors


def _sync(**kwargs: Any) -> OuterSync:
    return OuterSync(_model().named_parameters(), **({"sync_every": 4} | kwargs))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, r"sync_every=0 is not valid; it must be an integer >= 1"),
        ({"fragments": 3}, r"fragments=3 does not divide sync_every=4.* choose fragments from \[1, 2, 4\]"),
        ({"sync_every": 10, "fragments": 5}, r"fragments=5 is more than the 4 parameter tensors .* <= 4"),
        ({"overlap_steps": 4}, r"overlap_steps=4 is not valid; .* \[0, 3\]"),
        ({"compression": "fp8"}, r"compression='fp8' is not valid; choose one of none, bf16, int8"),
        ({"mode": "easgd"}, r"mode='easgd' is not valid; choose one of diloco, local_sgd"),
        ({"mode": "local_sgd", "compression": "int8"}, r"compression='int8' cannot serve mode='local_sgd'"),
        ({"mode": "local_sgd", "outer_optimizer": torch.optim.SGD}, r"mode='local_sgd' .* has no outer optimizer"),
        ({"outer_optimizer": lambda p: torch.optim.SGD(p, lr=0.0)}, r"outer optimizer's lr=0.0 is not valid"),
        ({"outer_optimizer": lambda p: torch.optim.SGD([{"params": p, "lr": 0.0}], lr=0.7)}, r"lr=0.0 is not"),
        ({"outer_optimizer": lambda p: torch.optim.SGD(p[:1], lr=0.7)}, r"exactly the tensors it is given"),
    ],
)
def test_bad_settings_name_the_value(world_of_one: None, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        _sync(**kwargs)


def test_no_parameters(world_of_one: None) -> None:
    with pytest.raises(ConfigurationError, match="no parameters"):
        OuterSync([], sync_every=4)


def test_steps_must_be_consecutive(world_of_one: None) -> None:
    sync = _sync()
    sync.after_inner_step(1)
    with pytest.raises(ConfigurationError, match=r"after_inner_step\(3\) was called after step 1"):
        sync.after_inner_step(3)


def test_state_from_other_settings(world_of_one: None) -> None:
    state = _sync(fragments=2).state_dict()
    with pytest.raises(ConfigurationError, match="fragments: saved 2, now 1"):
        _sync().load_state_dict(state)


def test_a_run_that_parted_cannot_turn_synchronous(world_of_one: None) -> None:
    parted = _sync().state_dict()
    with pytest.raises(ConfigurationError, match="synchronous_steps: saved None, now 8"):
        _sync(synchronous_steps=8).load_state_dict(parted)
    _sync().load_state_dict(_sync(synchronous_steps=8).state_dict())  # ending the synchronous start early is fine


def test_synchronous_steps_keep_the_global_model_and_send_nothing(world_of_one: None) -> None:
    model = _model()
    sync = OuterSync(model.named_parameters(), sync_every=2, synchronous_steps=4)
    psi_bytes = 4 * sum(p.numel() for p in model.parameters())
    for step in range(1, 6):
        assert sync.synchronous == (step <= 4)
        with torch.no_grad():
            model[0].weight += 1.0
        sync.after_inner_step(step)
        global_weight = dict(sync.named_globals())["0.weight"]
        if step <= 4:  # the global model follows the (identical) workers
            torch.testing.assert_close(global_weight, model[0].weight.detach())
            assert sync.bytes_sent == 0
    torch.testing.assert_close(global_weight + 1.0, model[0].weight.detach())  # step 5: the workers parted
    sync.after_inner_step(6)  # the first round, two steps after the synchronous start
    assert sync.bytes_sent == psi_bytes


def test_gradient_buckets_keep_order_dtype_and_cap() -> None:
    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(100), torch.zeros(1)]
    buckets = size_buckets(tensors, caps=(32, 32))
    assert [[t.numel() for t in bucket] for bucket in buckets] == [[4, 4], [4], [100], [1]]
    assert [t for bucket in buckets for t in bucket] == tensors


def test_world_of_one_lr_one_keeps_the_local_parameters(world_of_one: None) -> None:
    model = _model()
    sync = OuterSync(model.named_parameters(), sync_every=1, outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    with torch.no_grad():
        model[0].weight += 1.0
    expected = model[0].weight.detach().clone()
    sync.after_inner_step(1)
    torch.testing.assert_close(model[0].weight, expected)


def test_split_is_contiguous_and_balanced() -> None:
    assert split_fragments([10, 10, 5, 5], 2) == [[0], [1, 2, 3]]
    assert split_fragments([1, 1, 1, 100], 4) == [[0], [1], [2], [3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([5] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_int8_error_is_half_a_step_and_feedback_keeps_the_sum() -> None:
    torch.manual_seed(0)
    codec = Codec("int8", [50, 30])
    x = torch.randn(80)
    error = (codec.decode(codec.encode(x)) - x).abs()
    assert error[:50].max() <= x[:50].abs().max() / 127 / 2 + 1e-7
    assert torch.equal(codec.decode(codec.encode(torch.zeros(80))), torch.zeros(80))
    residual, sent, true = torch.zeros(80), torch.zeros(80), torch.zeros(80)
    for _ in range(20):  # error feedback: what was sent tracks what should have been, within one residual
        delta = torch.randn(80) * 1e-3
        payload = codec.encode(delta + residual)
        residual = delta + residual - codec.decode(payload)
        sent, true = sent + codec.decode(payload), true + delta
    torch.testing.assert_close(sent + residual, true, rtol=0, atol=1e-6)
