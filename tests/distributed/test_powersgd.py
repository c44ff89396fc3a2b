"""PowerSGD under bucketed_ddp: exact bytes, warm-up equal to plain all-reduce, the P/Q math and error feedback,
bitwise resume, and bad settings refused."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import train_tiny_gpt
from torch import nn

import lightscale
from lightscale.measure.comm_counter import CollectiveCounter
from lightscale.parallel import BucketedGradReducer
from lightscale.strategies.ddp.strategy import BucketedDDPStrategy
from lightscale.testing import run_distributed

# (n, m) of every gradient matrix of Net (a conv weight 3x2x3 is compressed as 3x6) and its vector sizes.
MATRICES = [(3, 6), (6, 9), (4, 6)]
VECTORS = [3, 6, 4]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, kernel_size=3)
        self.hidden = nn.Linear(9, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.conv(x).flatten(1))))


def _setup(compression: str = "powersgd", **kwargs: object) -> tuple[Net, BucketedGradReducer, torch.optim.SGD]:
    torch.manual_seed(0)
    model = Net()
    caps = {"bucket_cap_mb": 1e-4, "first_bucket_cap_mb": 1e-4}  # several buckets
    reducer = BucketedGradReducer(model, compression=compression, **caps, **kwargs)
    return model, reducer, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(step: int, micro: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())  # each rank its own data
    return torch.randn(4, 2, 5, generator=generator)


def _loss(model: Net, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _exact_average(model: Net, x: torch.Tensor) -> list[torch.Tensor]:
    """The true averaged gradient: autograd.grad fires no reducer hook; summed here with a plain all-reduce."""
    grads = [g.clone() for g in torch.autograd.grad(_loss(model, x), list(model.parameters()))]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return grads


# ---- (a) bytes --------------------------------------------------------------------------------------------------
def _bytes_per_step(rank: int, warmup: int, accumulate: int) -> list[int]:
    model, reducer, optimizer = _setup(powersgd_rank=rank, powersgd_warmup_steps=warmup)
    per_step = []
    with CollectiveCounter() as counter:
        for step in range(4):
            for micro in range(accumulate):
                with reducer.no_sync() if micro < accumulate - 1 else nullcontext():
                    _loss(model, _batch(step, micro)).backward()
            optimizer.step()
            optimizer.zero_grad()
            per_step.append(counter.totals()["all_reduce"].bytes)
            counter.reset()
    return per_step


@pytest.mark.parametrize("accumulate", [1, 2])
def test_bytes_equal_theory(accumulate: int) -> None:
    rank = 2
    compressed = 4 * (sum((n + m) * min(n, m, rank) for n, m in MATRICES) + sum(VECTORS))
    plain = 4 * (sum(n * m for n, m in MATRICES) + sum(VECTORS))
    assert (compressed, plain) == (324, 436)
    per_step = run_distributed(_bytes_per_step, rank, 2, accumulate, world_size=2, collective_timeout_s=30)[0]
    assert per_step == [plain, plain, compressed, compressed]  # two warm-up steps, then PowerSGD


# ---- (b) warm-up -------------------------------------------------------------------------------------------------
def _train(compression: str, steps: int) -> list[list[float]]:
    model, _, optimizer = _setup(compression, powersgd_rank=1, powersgd_warmup_steps=3)
    history = []
    for step in range(steps):
        _loss(model, _batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    return history


def test_warmup_equals_uncompressed() -> None:
    powersgd = run_distributed(_train, "powersgd", 4, world_size=2, collective_timeout_s=30)[0]
    plain = run_distributed(_train, "none", 4, world_size=2, collective_timeout_s=30)[0]
    for step in range(3):
        assert max(abs(a - b) for a, b in zip(powersgd[step], plain[step], strict=True)) <= 1e-6
    assert max(abs(a - b) for a, b in zip(powersgd[3], plain[3], strict=True)) > 1e-4  # then rank 1 compresses


# ---- (c) the P/Q math and error feedback --------------------------------------------------------------------------
def _full_rank_error() -> float:
    model, _, optimizer = _setup(powersgd_rank=9)  # >= min(n, m) of every matrix: lossless
    worst = 0.0
    for step in range(4):
        x = _batch(step)
        exact = _exact_average(model, x)
        _loss(model, x).backward()
        worst = max(worst, *((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), exact, strict=True)))
        optimizer.step()
        optimizer.zero_grad()
    return worst


def test_full_rank_equals_exact_average() -> None:
    worst = run_distributed(_full_rank_error, world_size=2, collective_timeout_s=30)
    assert max(worst) <= 1e-6


def _error_feedback_balance() -> float:
    model, reducer, _ = _setup(powersgd_rank=1)
    params = list(model.parameters())
    applied = [torch.zeros_like(p) for p in params]
    true = [torch.zeros_like(p) for p in params]
    for step in range(5):  # no optimizer step: the same point, five batches
        x = _batch(step)
        for total, grad in zip(true, _exact_average(model, x), strict=True):
            total += grad
        _loss(model, x).backward()
        for total, p in zip(applied, params, strict=True):
            total += p.grad
        model.zero_grad()
    # Residuals are kept per rank in 1/world units: their sum over ranks is what the updates still owe.
    owed = {id(p): torch.zeros_like(p) for p in params}
    psgd = reducer.powersgd
    for bucket, plan, residuals in zip(reducer.buckets, psgd.plans, psgd.residuals, strict=True):
        for i, residual in zip(plan.matrices, residuals, strict=True):
            total = residual.clone()
            dist.all_reduce(total)
            owed[id(bucket.params[i])] = total.view_as(bucket.params[i])
    assert sum(len(r) for r in psgd.residuals) == len(MATRICES)
    for k, p in enumerate(params):
        if p.ndim >= 2:
            assert (applied[k] - true[k]).abs().max().item() > 1e-4  # rank 1 did drop something
    return max((a + owed[id(p)] - t).abs().max().item() for a, p, t in zip(applied, params, true, strict=True))


def test_error_feedback_keeps_what_compression_dropped() -> None:
    worst = run_distributed(_error_feedback_balance, world_size=2, collective_timeout_s=30)
    assert max(worst) <= 1e-5


# ---- (d) save and resume -------------------------------------------------------------------------------------
def _strategy() -> BucketedDDPStrategy:
    return BucketedDDPStrategy(compression="powersgd", powersgd_rank=1, powersgd_warmup_steps=2)


def _resume(cache_dir: str, checkpoint: str) -> tuple[list[float], list[float], int]:
    common = {"devices": 2, "batch_size": 2, "cache_dir": cache_dir, "max_steps": 8, "sgd_lr": 0.25}
    uninterrupted = train_tiny_gpt(_strategy(), **common)
    first = train_tiny_gpt(_strategy(), stop_after=4, save_checkpoint_to=checkpoint, **common)
    second = train_tiny_gpt(_strategy(), resume_from=checkpoint, **common)
    saved = torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=False)["lightscale"]["powersgd"]
    return uninterrupted, first + second, saved[dist.get_rank()]["step"]


def test_resume_continues_bitwise(corpus_cache: str, tmp_path: Path) -> None:
    uninterrupted, resumed, saved_step = run_distributed(
        _resume, corpus_cache, str(tmp_path / "powersgd.ckpt"), world_size=2, timeout_s=300
    )[0]
    assert saved_step == 4
    assert len(resumed) == 8
    assert resumed == uninterrupted


# ---- (e) bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_rank_below_one_refused(rank: object) -> None:
    with pytest.raises(ValueError, match=rf"powersgd_rank={rank!r} is not valid.*integer >= 1"):
        BucketedDDPStrategy(compression="powersgd", powersgd_rank=rank)


def test_powersgd_only_under_bucketed_ddp() -> None:
    from lightscale.strategies.fsdp2.strategy import FSDP2Strategy

    with pytest.raises(ValueError, match=r"compression='powersgd' is valid only under the bucketed_ddp strategies"):
        FSDP2Strategy(compression="powersgd")


@pytest.mark.parametrize("precision", ["bf16-true", "16-mixed"])
def test_powersgd_needs_fp32_gradients(precision: str) -> None:
    with pytest.raises(ValueError, match=rf"compression='powersgd' with precision='{precision}' is not supported"):
        lightscale.Trainer(strategy=_strategy(), accelerator="cpu", devices=1, precision=precision)
