"""Lightning's own behaviours, tried with lightscale's names as a user's script meets them (scenarios from Lightning's
test suite; plain ``ddp`` passes each), on 2 gloo ranks:

* ``self.log("grad_norm", p.grad.norm(), sync_dist=True)``: a value computed from sharded parameters or gradients is
  a DTensor under fsdp2 and hsdp; the strategy's ``reduce`` takes its whole value (it raised ``NotImplementedError:
  Operator c10d.allreduce_.default does not have a sharding strategy registered``). The logged values equal one
  process's, computed here from the same weights and the whole batch.
* a ``DataLoader`` subclass with a constructor argument it does not store, built in ``train_dataloader()``: Lightning
  re-creates it with its sampler from the arguments it recorded while the hook ran, and the strategy re-creates that
  copy with its own sampler (it raised ``MisconfigurationException: Trying to inject custom Sampler into the
  CustomDataLoader instance``); every sample is trained once per epoch, split over the ranks.
* Lightning's ``StochasticWeightAveraging``: runs under bucketed_ddp and diloco (whole parameters, a torch optimizer,
  as under ddp) and is refused before training under fsdp2, parallel_3d and zero2, naming ``WeightAveraging`` (it
  crashed at the first update: ``aten.copy_.default got mixed torch.Tensor and DTensor``, ``DeepSpeedZeroOptimizer is
  not an Optimizer``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightscale
from lightscale.strategies import DiLoCoStrategy, FSDP2Strategy, Parallel3DStrategy
from lightscale.testing import run_distributed

BATCH = 2  # per rank
STRATEGIES: dict[str, Any] = {
    "bucketed_ddp": lambda: "bucketed_ddp",
    "fsdp2": lambda: FSDP2Strategy(meta_init=False),  # the weights the module was built with, as in one process
    "hsdp": lambda: FSDP2Strategy(dp_replicate=2, dp_shard=1, meta_init=False),
    "parallel_3d": lambda: Parallel3DStrategy(dp=2),
    "diloco": lambda: DiLoCoStrategy(workers=2, sync_every=2),
    "zero2": lambda: "zero2",
}
LOGGED = ("bucketed_ddp", "fsdp2", "hsdp")
SWA_RUNS, SWA_REFUSED = ("bucketed_ddp", "diloco"), ("fsdp2", "parallel_3d", "zero2")


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return lightscale.Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), **quiet, **kwargs)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(8, 4, generator=generator), torch.randn(8, 3, generator=generator))


class GradNorm(pl.LightningModule):
    """Logs the norms of its weight and of its first step's gradient, synced, as users log them."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.batch = batch  # which samples this rank drew (the sampler shuffles): the one-process reference's batch
        self.log("weight_norm", self.layer.weight.norm(), sync_dist=True, on_step=False, on_epoch=True)
        return (self.layer(batch[0]) - batch[1]).pow(2).mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.layer.weight.grad is not None
        self.log("grad_norm", self.layer.weight.grad.norm(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _log(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer, model = _trainer(STRATEGIES[name](), max_steps=1), GradNorm()
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH))
    return {"logged": {key: float(value) for key, value in trainer.callback_metrics.items()}, "batch": model.batch}


def _one_process_norms(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """The first step in this process: the gradient of the mean loss over both ranks' batches (one global batch),
    and the weight before the step (the epoch's mean over one step)."""
    torch.manual_seed(0)
    model = GradNorm()
    (model.layer(inputs) - targets).pow(2).mean().backward()
    assert model.layer.weight.grad is not None
    return {"grad_norm": float(model.layer.weight.grad.norm()), "weight_norm": float(model.layer.weight.norm())}


class CustomDataLoader(DataLoader):
    """A constructor argument it does not keep (Lightning's own test): only the arguments recorded while
    ``train_dataloader()`` ran can re-create it."""

    def __init__(self, num_features: int, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)


class SeesSamples(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.seen: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return CustomDataLoader(1, TensorDataset(torch.arange(12.0).view(12, 1)), batch_size=BATCH, shuffle=True)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen += [int(value) for value in batch[0].view(-1)]
        return self.layer(batch[0]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader_subclass(name: str) -> list[int]:
    model = SeesSamples()
    _trainer(STRATEGIES[name](), max_epochs=1).fit(model)
    return model.seen


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return (self.layer(batch[0]) - batch[1]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _swa(name: str) -> str:
    torch.manual_seed(0)
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
    trainer = _trainer(STRATEGIES[name](), max_epochs=3, callbacks=[swa])
    try:
        trainer.fit(Regression(), DataLoader(_data(), batch_size=BATCH))
    except Exception as error:  # every rank raises the refusal; the test reads it
        return f"{type(error).__name__}: {error}"
    return f"averaged {int(swa.n_averaged)}"  # type: ignore[arg-type]


def _launch() -> dict[str, Any]:
    return {
        "logged": {name: _log(name) for name in LOGGED},
        "seen": {name: _loader_subclass(name) for name in ("bucketed_ddp", "fsdp2")},
        "swa": {name: _swa(name) for name in (*SWA_RUNS, *SWA_REFUSED)},
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_launch, world_size=2, timeout_s=600)


@pytest.mark.parametrize("name", LOGGED)
def test_sync_dist_of_a_value_computed_from_sharded_parameters_equals_one_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    batches = [rank["logged"][name]["batch"] for rank in ranks]
    expected = _one_process_norms(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    for rank in ranks:
        logged = rank["logged"][name]["logged"]
        assert logged["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6), logged
        assert logged["weight_norm"] == pytest.approx(expected["weight_norm"], rel=1e-6), logged


@pytest.mark.parametrize("name", ["bucketed_ddp", "fsdp2"])
def test_a_dataloader_subclass_built_in_the_hook_trains_every_sample_once(
    ranks: list[dict[str, Any]], name: str
) -> None:
    seen = [rank["seen"][name] for rank in ranks]
    assert all(len(mine) == 6 for mine in seen), seen  # 12 samples split over 2 ranks
    assert sorted(seen[0] + seen[1]) == list(range(12)), seen


@pytest.mark.parametrize("name", SWA_RUNS)
def test_stochastic_weight_averaging_runs_where_parameters_are_whole(ranks: list[dict[str, Any]], name: str) -> None:
    assert all(rank["swa"][name] == "averaged 3" for rank in ranks), [rank["swa"][name] for rank in ranks]


@pytest.mark.parametrize("name", SWA_REFUSED)
def test_stochastic_weight_averaging_is_refused_before_training_naming_what_works(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for rank in ranks:
        message = rank["swa"][name]
        assert message.startswith("ConfigurationError: Lightning's StochasticWeightAveraging callback does not run")
        assert "WeightAveraging instead" in message and "bucketed_ddp" in message, message
