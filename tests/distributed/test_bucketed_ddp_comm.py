"""Exact communication of bucketed_ddp: one all-reduce of all gradient bytes per optimizer step, none on
gradient-accumulation micro-steps, half the bytes with bf16 on the wire."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, train_tiny_gpt

from lightscale.callbacks import CommMonitor
from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.parallel import BucketedGradReducer
from lightscale.recipes.gpt import GPT
from lightscale.testing import RankFailed, run_distributed


def _gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights are listed once


def _bytes_per_step(compression: str, accumulate: int) -> tuple[list[int], int, int]:
    torch.manual_seed(0)
    model = GPT(TINY)
    reducer = BucketedGradReducer(model, bucket_cap_mb=0.05, first_bucket_cap_mb=0.01, compression=compression)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    per_step = []
    with CollectiveCounter() as counter:
        for _ in range(3):
            for micro in range(accumulate):
                sync = micro == accumulate - 1
                with reducer.no_sync() if not sync else _null():
                    model(tokens).float().logsumexp(-1).mean().backward()
            per_step.append(counter.totals()["all_reduce"].bytes)
            counter.reset()
    return per_step, _gradient_bytes(model), len(reducer.buckets)


class _null:
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...


@pytest.mark.parametrize("accumulate", [1, 3])
def test_all_gradient_bytes_reduced_once_per_step(accumulate: int) -> None:
    per_step, grad_bytes, buckets = run_distributed(_bytes_per_step, "none", accumulate, world_size=2)[0]
    assert grad_bytes == 4 * GPT(TINY).num_params()
    assert buckets > 1  # the test exercises several buckets
    assert per_step == [grad_bytes] * 3


def test_bf16_wire_halves_the_bytes() -> None:
    per_step, grad_bytes, _ = run_distributed(_bytes_per_step, "bf16", 1, world_size=2)[0]
    assert per_step == [grad_bytes // 2] * 3


def _all_reduced_per_step(cache_dir: str) -> tuple[list[int], int]:
    monitor = CommMonitor(every_n_steps=1, min_bytes=9)  # Lightning's own reductions are scalars
    train_tiny_gpt(
        "bucketed_ddp",
        devices=2,
        batch_size=2,
        accumulate=2,
        max_steps=4,
        cache_dir=cache_dir,
        extra_callbacks=[monitor],
    )
    return [step["all_reduce"].bytes for step in monitor.records], _gradient_bytes(GPT(TINY))


def test_lightning_accumulation_skips_micro_step_sync(corpus_cache: str) -> None:
    per_step, grad_bytes = run_distributed(_all_reduced_per_step, corpus_cache, world_size=2)[0]
    assert per_step == [grad_bytes] * 4  # 4 optimizer steps x 2 micro-steps: one reduction per optimizer step


def _unused_parameter_backward(find_unused: bool) -> tuple[list[float] | None, list[float]]:
    """``unused`` gets no gradient anywhere; ``sometimes`` only on rank 0."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(4, 4) for name in ("used", "unused", "sometimes")})
    reducer = BucketedGradReducer(model, find_unused_parameters=find_unused)
    loss = model["used"](torch.ones(2, 4)).sum()
    if dist.get_rank() == 0:
        loss = loss + model["sometimes"](torch.ones(2, 4)).sum()
    loss.backward()
    reducer.remove()
    unused = model["unused"].weight.grad
    return (None if unused is None else unused.flatten().tolist()), model["sometimes"].weight.grad.flatten().tolist()


def test_unused_parameter_is_a_clear_error() -> None:
    with pytest.raises(RankFailed, match=r"received no gradient.*unused\.weight.*find_unused_parameters=True"):
        run_distributed(_unused_parameter_backward, False, world_size=2, collective_timeout_s=10)


def test_unused_parameter_flag_averages_with_zeros() -> None:
    (unused0, sometimes0), (unused1, sometimes1) = run_distributed(_unused_parameter_backward, True, world_size=2)
    assert unused0 is None and unused1 is None  # unused on every rank: left alone, as torch DDP does
    assert sometimes0 == sometimes1 == [1.0] * 16  # rank 0's gradient (2.0) averaged with rank 1's zeros


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in backward")


def _recovers_after_failed_backward() -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    reducer = BucketedGradReducer(model, bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5)
    hidden = _FailingBackward.apply(model[0](torch.ones(1, 4)))
    with pytest.raises(RuntimeError, match="injected failure"):
        model[1](hidden).sum().backward()  # model[1]'s hooks fire, then the failure: the callback never runs
    model.zero_grad()
    x = torch.full((1, 4), float(dist.get_rank() + 1))
    model(x).sum().backward()
    reducer.remove()
    return model[0].weight.grad.flatten().tolist()


def test_a_failed_backward_does_not_stop_later_synchronization() -> None:
    grads = run_distributed(_recovers_after_failed_backward, world_size=2, collective_timeout_s=10)
    assert grads[0] == grads[1]  # still averaged over ranks (inputs differ per rank)


def _buffers_after_sync() -> list[float]:
    model = torch.nn.BatchNorm1d(3)
    reducer = BucketedGradReducer(model)
    model.running_mean.fill_(float(dist.get_rank() + 5))  # ranks drift apart...
    reducer.sync_buffers()  # ...and are realigned on rank 0's statistics
    return model.running_mean.tolist()


def test_sync_buffers_copies_rank0() -> None:
    assert run_distributed(_buffers_after_sync, world_size=2) == [[5.0] * 3, [5.0] * 3]
