"""Per-step fault tolerance's commit gate and mean, without a lighthouse: ``BucketedDDPStrategy(fault_tolerant=...)``
fits a user's model in this process, its torchft ``Manager`` replaced by a fake (the seam:
``FaultTolerantReplica(settings, manager=...)``) that plays a peer replica the way torchft's manager does.

* the gradient applied is the mean over the replicas that took part: the peer's gradient (every element a known
  value) plus ours, divided by ``num_participants`` — compared bitwise with plain SGD with momentum on that mean;
* ``should_commit`` False (a peer of the step failed) or a failed collective: nobody applies the step (parameters
  and momentum unchanged, torchft's step count not advanced), it is counted as dropped and logged ``ft/replicas`` 0,
  and the next step trains on clean gradients;
* manual optimization: one ``optimizer.step()`` per batch works like automatic optimization; several optimizers,
  or a second step in one batch, are refused before they run (one quorum and one commit per batch);
* the reduction across replicas runs during backward, bucket by bucket in the reducer's order (overlapped with the
  rest of backward, as torch DDP's comm hook), not after it.
"""

from __future__ import annotations

import inspect
import os
import re
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader, TensorDataset

from lightscale import FaultTolerance
from lightscale.data.sampler import ExactlyOnceSampler
from lightscale.errors import ConfigurationError
from lightscale.fault_tolerance.replica import FaultTolerantReplica
from lightscale.strategies import BucketedDDPStrategy
from lightscale.testing import run_distributed

SAMPLES, BATCH, LR, MOMENTUM = 64, 8, 0.1, 0.9
PEER_GRADIENT = (0.5, -0.25, 1.0, 0.125)  # every element of the peer's gradient, step by step
SETTINGS = FaultTolerance(replica_id="replica_0", lighthouse="http://127.0.0.1:1", min_replicas=1)


class _Work:
    """What torchft's ``allreduce`` returns: ``wait()`` never raises; False when the reduction failed (reported to
    the manager)."""

    def __init__(self, ok: bool, finish: Any = None) -> None:
        self.ok = ok
        self.finish = finish  # torchft divides by the participants only in wait(): a missed wait shows

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return self.ok


class FakeManager:
    """torchft ``Manager``'s methods this package calls, with its semantics: ``allreduce`` (``ReduceOp.AVG``) sums
    over the quorum (here: ours and the peer's, a known value per element) and divides by ``num_participants``; an
    error is recorded, not raised, and ``should_commit`` answers False then; ``start_quorum`` clears it; the step
    count advances only on a commit. ``peer_fails``: steps (quorums, from 1) whose peer fails before the commit;
    ``collective_fails``: steps whose all-reduce fails (the tensor left corrupted, as torchft warns it may be)."""

    def __init__(
        self, *, participants: int = 2, peer_fails: tuple[int, ...] = (), collective_fails: tuple[int, ...] = ()
    ):
        self.participants = participants
        self.peer_fails, self.collective_fails = peer_fails, collective_fails
        self._step = 0
        self.quorums = 0
        self.reductions = 0
        self.reduced: list[tuple[int, bool]] = []  # (elements, inside backward) of each all-reduce
        self._errored: Exception | None = None

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        self.quorums += 1
        self._errored = None

    def num_participants(self) -> int:
        return self.participants

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: ReduceOp = ReduceOp.AVG
    ) -> _Work:
        if self._errored is not None:
            return _Work(True)  # torchft's _DummyWork: a no-op after the step's first error, the tensor untouched
        self.reductions += 1
        self.reduced.append((tensor.numel(), torch._C._current_graph_task_id() != -1))
        if self.quorums in self.collective_fails:
            tensor.fill_(float("nan"))
            self.report_error(RuntimeError("gloo: connection reset by peer"))
            return _Work(False)
        tensor.add_(PEER_GRADIENT[self._step % len(PEER_GRADIENT)])  # the peers' sum (one peer here)
        if reduce_op != ReduceOp.AVG:
            return _Work(True)
        participants = self.participants
        return _Work(True, lambda: tensor.div_(participants))  # torchft: the mean over the quorum, at wait()

    def report_error(self, e: Exception) -> None:
        self._errored = e

    def errored(self) -> Exception | None:
        return self._errored

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        commit = self._errored is None and self.quorums not in self.peer_fails
        self._step += commit
        return commit

    def current_step(self) -> int:
        return self._step

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step = state_dict["step"]

    def shutdown(self, wait: bool = True) -> None:
        pass


DATA = torch.randn(SAMPLES, 5, generator=torch.Generator().manual_seed(1))
TARGETS = DATA.sum(-1, keepdim=True).cos()


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 1))


class Regression(pl.LightningModule):
    """The user's model: SGD with momentum, its own dataset, automatic optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _network()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(DATA, TARGETS), batch_size=BATCH)


class ManualRegression(Regression):
    """The same under manual optimization: ``steps`` optimizer steps per batch, over ``optimizers`` optimizers."""

    def __init__(self, *, steps: int = 1, optimizers: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.steps, self.optimizer_count = steps, optimizers

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers] * self.steps:
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self.net(batch[0]), batch[1]))
            optimizer.step()

    def configure_optimizers(self) -> Any:
        if self.optimizer_count == 1:
            return super().configure_optimizers()
        first, second = self.net[0].parameters(), self.net[2].parameters()
        return [torch.optim.SGD(first, lr=LR), torch.optim.SGD(second, lr=LR)]


class Metrics(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    name = "metrics"
    version = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


class States(pl.Callback):
    """Parameters and momentum buffers after every batch."""

    def __init__(self) -> None:
        self.after: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        params = [p.detach().clone() for p in module.parameters()]
        state = trainer.optimizers[0].state
        momenta = [state[p]["momentum_buffer"].clone() for p in module.parameters() if p in state]
        self.after.append((params, momenta))


def _fit(module: pl.LightningModule, manager: FakeManager, steps: int, bucket_cap_mb: float = 25.0) -> dict[str, Any]:
    """The fit in a forked one-rank process (``run_distributed``): its process group dies with it, not with pytest's
    process, which later unit tests share. What the fit left: parameters, states per batch, the fake's counts."""
    return run_distributed(_fit_in_this_process, module, manager, steps, bucket_cap_mb, world_size=1, timeout_s=120)[0]


def _fit_in_this_process(
    module: pl.LightningModule, manager: FakeManager, steps: int, bucket_cap_mb: float
) -> dict[str, Any]:
    strategy = BucketedDDPStrategy(
        fault_tolerant=SETTINGS, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=bucket_cap_mb
    )
    strategy.ft = FaultTolerantReplica(SETTINGS, manager=manager)  # the fake in place of torchft's
    metrics, states = Metrics(), States()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=metrics,
        callbacks=[states],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    refused = None
    try:
        trainer.fit(module)
    except ConfigurationError as error:
        refused = str(error)
    return {
        "refused": refused,
        "params": [p.detach() for p in module.parameters()],
        "after": states.after,
        "replicas": [row["ft/replicas"] for _, row in metrics.rows if "ft/replicas" in row],
        "committed": manager.current_step(),
        "quorums": manager.quorums,
        "reductions": manager.reductions,
        "reduced": manager.reduced,
        "global_step": trainer.global_step,
        "summary": strategy.ft.summary(),
    }


def _plain_sgd(steps: int, *, dropped: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Plain SGD with momentum whose gradient at step k is the mean of ours and the peer's (1-based ``dropped`` steps
    skipped: their batch read, nothing applied). The batches in the order a one-rank fit reads them: Lightning's
    shuffled training sampler (seed ``PL_GLOBAL_SEED``), lightscale's in its place."""
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    order = list(ExactlyOnceSampler(range(SAMPLES), batch_size=BATCH, num_replicas=1, rank=0, shuffle=True, seed=seed))
    net = _network()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    committed = 0
    for step in range(1, steps + 1):
        if step in dropped:
            continue
        index = order[(step - 1) * BATCH : step * BATCH]
        x, y = DATA[index], TARGETS[index]
        optimizer.zero_grad()
        F.mse_loss(net(x), y).backward()
        peer = PEER_GRADIENT[committed % len(PEER_GRADIENT)]
        for p in net.parameters():
            p.grad = (p.grad + peer) / 2
        optimizer.step()
        committed += 1
    return [p.detach() for p in net.parameters()]


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_the_fake_calls_torchft_managers_methods_as_they_are() -> None:
    from torchft.manager import Manager

    for name in (
        "start_quorum",
        "num_participants",
        "allreduce",
        "should_commit",
        "current_step",
        "shutdown",
        "load_state_dict",
        "report_error",
        "errored",
    ):
        real, fake = inspect.signature(getattr(Manager, name)), inspect.signature(getattr(FakeManager, name))
        assert list(real.parameters) == list(fake.parameters), name
        assert [p.default for p in real.parameters.values()] == [p.default for p in fake.parameters.values()], name


def test_the_step_applies_the_mean_over_the_replicas_that_took_part() -> None:
    fit = _fit(Regression(), FakeManager(participants=2), steps=4)
    _assert_equal(fit["params"], _plain_sgd(4))
    assert fit["committed"] == 4 and fit["quorums"] == 4 and fit["replicas"] == [2.0] * 4


def test_each_bucket_is_averaged_across_replicas_during_backward_in_bucket_order() -> None:
    """Buckets of one parameter each (a 1-byte cap): the reducer's order is the parameters' reversed (the last layer's
    gradients come first in backward), and each bucket's all-reduce across replicas starts inside backward."""
    fit = _fit(Regression(), FakeManager(participants=2), steps=3, bucket_cap_mb=1e-6)
    sizes = [p.numel() for p in _network().parameters()][::-1]  # [1, 12, 12, 60]
    assert fit["reduced"] == [(size, True) for size in sizes] * 3
    _assert_equal(fit["params"], _plain_sgd(3))  # the same mean as one reduction after backward


@pytest.mark.parametrize("failure", ["peer_fails", "collective_fails"])
def test_a_failed_step_is_applied_by_nobody(failure: str) -> None:
    fit = _fit(Regression(), FakeManager(participants=2, **{failure: (2,)}), steps=3)
    (params_1, momenta_1), (params_2, momenta_2), _ = fit["after"]
    _assert_equal(params_2, params_1)  # step 2: no optimizer step
    _assert_equal(momenta_2, momenta_1)
    assert len(momenta_1) == 4  # SGD's momentum buffers exist (step 1 ran) and did not move
    assert fit["committed"] == 2  # torchft's count: steps 1 and 3 committed
    assert fit["global_step"] == 3  # Lightning counts step() calls (docs/fault_tolerance.md: it moves)
    assert fit["replicas"] == [2.0, 0.0, 2.0]
    assert "1 dropped (trained by none)" in fit["summary"]
    # after the dropped step (NaN gradients when its collective failed) step 3 trains on batch 3 alone
    _assert_equal(fit["params"], _plain_sgd(3, dropped=(2,)))


def test_manual_optimization_with_one_step_per_batch_is_the_same_mean() -> None:
    fit = _fit(ManualRegression(), FakeManager(participants=2), steps=4)
    _assert_equal(fit["params"], _plain_sgd(4))
    assert fit["committed"] == 4 and fit["replicas"] == [2.0] * 4


def test_a_second_step_in_one_batch_is_refused_before_it_runs() -> None:
    fit = _fit(ManualRegression(steps=2), FakeManager(participants=2), steps=4)
    assert re.search(r"one optimizer.step\(\) per training batch.*no quorum of its own", fit["refused"] or "")
    assert fit["committed"] == 1 and fit["reductions"] == 1  # the batch's first step ran, the second did not


def test_several_optimizers_are_refused_before_the_first_quorum() -> None:
    fit = _fit(ManualRegression(optimizers=2), FakeManager(participants=2), steps=4)
    assert re.search(r"runs one optimizer.*configure_optimizers returned 2", fit["refused"] or "")
    assert fit["quorums"] == 0
