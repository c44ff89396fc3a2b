"""Exactness of OuterSync (DiLoCo / local SGD) against hand-written references, on gloo with a tiny MLP.

Each worker is one rank (or, in the first test, two ranks with data parallelism inside the worker); every rank
trains on its own deterministic batches, so workers drift apart between syncs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.parallel.diloco import OuterSync, default_outer_step
from lightscale.testing import run_distributed

LR = 0.1


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # 4 tensors, 83 parameters


def _loss(model: nn.Module, rank: int, step: int) -> Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
    return nn.functional.mse_loss(model(x), y)


def _mean_over(value: float, group: dist.ProcessGroup | None = None) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)


def _inner_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, group: dist.ProcessGroup | None) -> float:
    """One inner step; gradients averaged over ``group`` (data parallelism inside the worker) unless it is None."""
    loss = _loss(model, dist.get_rank(), step)
    loss.backward()
    if group is not None:
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)
            param.grad /= dist.get_world_size(group)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# (a) H=1, outer SGD lr 1 without momentum == synchronous data parallelism over all ranks --------------------------


def _h1_vs_data_parallel(steps: int) -> tuple[list[float], list[float]]:
    rank = dist.get_rank()
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # 2 workers of 2 ranks
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the ranks at the same position in each worker
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reference = [_mean_over(_inner_step(model, opt, step, dist.group.WORLD)) for step in range(1, steps + 1)]

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = OuterSync(
        model.named_parameters(),
        sync_every=1,
        group=outer[rank % 2],
        outer_optimizer=lambda p: torch.optim.SGD(p, lr=1.0),
    )
    losses = []
    for step in range(1, steps + 1):
        losses.append(_mean_over(_inner_step(model, opt, step, inner[rank // 2])))
        sync.after_inner_step(step)
    return reference, losses


def test_h1_equals_synchronous_data_parallel() -> None:
    for reference, losses in run_distributed(_h1_vs_data_parallel, 6, world_size=4):
        assert max(abs(a - b) for a, b in zip(reference, losses, strict=True)) <= 1e-6
        assert reference[-1] < reference[0]  # it trains


# (b) local SGD == hand-written parameter averaging every H steps -------------------------------------------------


def _local_sgd(steps: int, every: int) -> tuple[list[Tensor], list[Tensor]]:
    model = _model(seed=dist.get_rank())  # different starts: the broadcast must make them equal
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    for step in range(1, steps + 1):
        _inner_step(model, opt, step, None)
        if step % every == 0:
            with torch.no_grad():
                for param in model.parameters():
                    dist.all_reduce(param)
                    param /= dist.get_world_size()
    reference = _params(model)

    model = _model(seed=dist.get_rank())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    sync = OuterSync(model.named_parameters(), sync_every=every, mode="local_sgd")
    for step in range(1, steps + 1):
        _inner_step(model, opt, step, None)
        sync.after_inner_step(step)
    return reference, _params(model)


def test_local_sgd_equals_parameter_averaging() -> None:
    results = run_distributed(_local_sgd, 7, 3, world_size=3)
    for reference, params in results:
        for ref, param in zip(reference, params, strict=True):
            torch.testing.assert_close(param, ref, rtol=0, atol=1e-6)
    assert not torch.equal(results[0][1][0], results[1][1][0])  # one step after the sync at 6 the workers differ


# (c, d) the outer Nesterov step, whole-model and streamed in fragments, against a hand-written reference --------


def _nesterov_reference(steps: int, every: int, fragments: list[list[int]], overlap: int) -> list[Tensor]:
    """DiLoCo written out: fragment f sends at steps s with (s - f*H/k) % H == 0, its mean pseudo-gradient
    d = mean_workers(global - local) lands ``overlap`` steps later: buf = mu*buf + d (buf = d the first time),
    global -= lr * (d + mu*buf), and the worker's fragment is reset to the new global."""
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    glob = [p.detach().clone() for p in params]
    buf: list[Tensor | None] = [None] * len(params)
    in_flight: list[tuple[int, list[int], list[Tensor]]] = []
    offsets = [f * every // len(fragments) for f in range(len(fragments))]
    outer_lr, mu = default_outer_step(every)  # what OuterSync builds when given no outer optimizer
    for step in range(1, steps + 1):
        _inner_step(model, opt, step, None)
        sends = [f for f in range(len(fragments)) if (step - offsets[f]) % every == 0]
        for f in sends:
            deltas = [glob[i] - params[i].detach() for i in fragments[f]]
            for delta in deltas:
                dist.all_reduce(delta)
                delta /= dist.get_world_size()
            in_flight.append((step + overlap, fragments[f], deltas))
        for due in [item for item in in_flight if item[0] == step]:
            in_flight.remove(due)
            for i, d in zip(due[1], due[2], strict=True):
                buf[i] = d.clone() if buf[i] is None else mu * buf[i] + d
                glob[i] = glob[i] - outer_lr * (d + mu * buf[i])
                params[i].data.copy_(glob[i])
    return _params(model)


def _diloco(steps: int, every: int, fragments: int, overlap: int) -> tuple[list[Tensor], list[Tensor], list]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sync = OuterSync(model.named_parameters(), sync_every=every, fragments=fragments, overlap_steps=overlap)
    for step in range(1, steps + 1):
        _inner_step(model, opt, step, None)
        sync.after_inner_step(step)
    split = [f.indices for f in sync.fragments]
    return _nesterov_reference(steps, every, split, overlap), _params(model), split


@pytest.mark.parametrize(("fragments", "overlap"), [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_outer_nesterov_matches_hand_written(fragments: int, overlap: int) -> None:
    results = run_distributed(_diloco, 9, 4, fragments, overlap, world_size=3)
    for reference, params, split in results:
        assert len(split) == fragments and sorted(i for f in split for i in f) == [0, 1, 2, 3]
        for ref, param in zip(reference, params, strict=True):
            torch.testing.assert_close(param, ref, rtol=0, atol=1e-6)


# (e) bytes: Psi / H per inner step, times the compression ratio --------------------------------------------------


def _bytes(steps: int, every: int) -> dict[tuple[str, int], tuple[list[int], int, int]]:
    out = {}
    for compression in ("none", "bf16", "int8"):
        for fragments in (1, 2):
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            sync = OuterSync(model.named_parameters(), sync_every=every, fragments=fragments, compression=compression)
            per_step = []
            with CollectiveCounter() as counter:
                for step in range(1, steps + 1):
                    before = sync.bytes_sent
                    _inner_step(model, opt, step, None)
                    sync.after_inner_step(step)
                    per_step.append(sync.bytes_sent - before)
            totals = counter.totals()["all_reduce" if compression == "none" else "all_gather"]
            out[compression, fragments] = per_step, totals.bytes, totals.calls
    return out


def test_bytes_per_inner_step() -> None:
    steps, every, world = 8, 4, 2
    psi = 4 * 83  # fp32 parameter bytes
    payload = {"none": psi, "bf16": psi // 2, "int8": 83 + 4 * 4}  # int8: one byte per value + an fp32 scale per tensor
    out = run_distributed(_bytes, steps, every, world_size=world)[0]
    for (compression, fragments), (per_step, counted, calls) in out.items():
        assert sum(per_step) == payload[compression] * steps // every  # Psi / H per step, exactly
        assert calls == fragments * steps // every  # one collective per fragment sync
        assert counted == sum(per_step) * (1 if compression == "none" else world)  # all-gather: W payloads land
    assert out["none", 1][0] == [0, 0, 0, psi] * 2
    assert out["none", 2][0][:4] == [0, 4 * (8 * 1 + 24 + 3), 0, 4 * 48]  # fragments [[0], [1, 2, 3]]


# (f) state_dict round trip mid-round resumes bitwise -------------------------------------------------------------


def _make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, OuterSync]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sync = OuterSync(model.named_parameters(), sync_every=4, fragments=2, overlap_steps=1, compression="int8")
    return model, opt, sync


def _resume(steps: int, stop: int) -> tuple[list[Tensor], list[Tensor], bool]:
    model, opt, sync = _make(0)
    saved = None
    for step in range(1, steps + 1):
        _inner_step(model, opt, step, None)
        sync.after_inner_step(step)
        if step == stop:
            in_flight = bool(sync._pending)
            saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sync.state_dict()))
    uninterrupted = _params(model)

    model, opt, sync = _make(7)  # another start: everything must come from the saved state
    model.load_state_dict(saved[0])  # after OuterSync's start broadcast: mid-round the workers differ
    opt.load_state_dict(saved[1])
    sync.load_state_dict(saved[2])
    for step in range(stop + 1, steps + 1):
        _inner_step(model, opt, step, None)
        sync.after_inner_step(step)
    return uninterrupted, _params(model), in_flight


def test_state_dict_resumes_bitwise_mid_round() -> None:
    for uninterrupted, resumed, in_flight in run_distributed(_resume, 11, 6, world_size=2):
        assert in_flight  # fragment 1 was sent at step 6 and lands at step 7
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert torch.equal(a, b)


# Compressed outer syncs stay close to the fp32 one (the decode and fp32 sum over workers are right) ----------------


def _compressed(steps: int) -> dict[str, list[Tensor]]:
    out = {"start": _params(_model())}
    for compression in ("none", "bf16", "int8"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        sync = OuterSync(model.named_parameters(), sync_every=2, fragments=2, compression=compression)
        for step in range(1, steps + 1):
            _inner_step(model, opt, step, None)
            sync.after_inner_step(step)
        out[compression] = _params(model)
    return out


def test_compressed_syncs_track_fp32() -> None:
    out = run_distributed(_compressed, 12, world_size=3)[0]
    moved = max((a - b).abs().max().item() for a, b in zip(out["none"], out["start"], strict=True))
    for compression, tolerance in (("bf16", 0.002), ("int8", 0.005)):
        error = max((a - b).abs().max().item() for a, b in zip(out[compression], out["none"], strict=True))
        assert 0 < error <= tolerance * moved
