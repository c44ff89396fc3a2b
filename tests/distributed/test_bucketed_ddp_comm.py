"""Exact communication of bucketed_ddp: one all-reduce of all gradient bytes per optimizer step, none on
gradient-accumulation micro-steps, half the bytes with bf16 on the wire."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, train_tiny_gpt

from lightscale.parallel import BucketedGradReducer
from lightscale.recipes.gpt import GPT
from lightscale.testing import RankFailed, run_distributed


class AllReduceCounter:
    """Records the bytes of every tensor passed to ``torch.distributed.all_reduce`` while installed."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._original = dist.all_reduce

    def __enter__(self) -> AllReduceCounter:
        def counting(tensor, *args, **kwargs):
            self.sizes.append(tensor.numel() * tensor.element_size())
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._original


def _gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights are listed once


def _bytes_per_step(compression: str, accumulate: int) -> tuple[list[int], int, int]:
    torch.manual_seed(0)
    model = GPT(TINY)
    reducer = BucketedGradReducer(model, bucket_cap_mb=0.05, first_bucket_cap_mb=0.01, compression=compression)
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    per_step = []
    with AllReduceCounter() as counter:
        for _ in range(3):
            for micro in range(accumulate):
                sync = micro == accumulate - 1
                with reducer.no_sync() if not sync else _null():
                    model(tokens).float().logsumexp(-1).mean().backward()
            per_step.append(sum(counter.sizes))
            counter.sizes.clear()
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


def _count_big_all_reduces(cache_dir: str) -> tuple[int, int]:
    with AllReduceCounter() as counter:
        train_tiny_gpt("bucketed_ddp", devices=2, batch_size=2, accumulate=2, max_steps=4, cache_dir=cache_dir)
    gradient_traffic = sum(size for size in counter.sizes if size > 8)  # Lightning's own reductions are scalars
    return gradient_traffic, _gradient_bytes(GPT(TINY))


def test_lightning_accumulation_skips_micro_step_sync(corpus_cache: str) -> None:
    traffic, grad_bytes = run_distributed(_count_big_all_reduces, corpus_cache, world_size=2)[0]
    assert traffic == 4 * grad_bytes  # 4 optimizer steps x 2 micro-steps: one reduction per optimizer step


def _unused_parameter_backward(find_unused: bool) -> list[float]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    reducer = BucketedGradReducer(model, find_unused_parameters=find_unused)
    model["used"](torch.ones(2, 4)).sum().backward()
    reducer.remove()
    return model["unused"].weight.grad.flatten().tolist()


def test_unused_parameter_is_a_clear_error() -> None:
    with pytest.raises(RankFailed, match=r"received no gradient.*unused\.weight.*find_unused_parameters=True"):
        run_distributed(_unused_parameter_backward, False, world_size=2, collective_timeout_s=10)


def test_unused_parameter_flag_reduces_zeros() -> None:
    grads = run_distributed(_unused_parameter_backward, True, world_size=2)
    assert grads[0] == grads[1] == [0.0] * 16
