"""Lightning's everyday features under every strategy family, as a user combines them (a reduced matrix).

One launch of 2 gloo ranks runs, per family (bucketed_ddp, fsdp2, zero2, zero3_offload, parallel_3d with dp=2,
diloco), one fit of a classifier defined here with everything at once: ``ModelCheckpoint(monitor="val_loss",
save_top_k=2, save_last=True)``, ``EarlyStopping``,
``LearningRateMonitor`` on a step-wise ``StepLR``, gradient clipping, gradient accumulation, ``val_check_interval``,
a torchmetrics metric, a CSV logger; then ``validate(ckpt_path="best")``, ``test(ckpt_path="last")``, ``predict`` and
a resumed ``fit(ckpt_path="last")``. This process then loads the best checkpoint with ``load_from_checkpoint``.
A second launch runs manual optimization with two optimizers (a small GAN): ``BucketedDDPStrategy(
find_unused_parameters=True)``, fsdp2, hsdp and ``parallel_3d`` (FSDP2 over ``dp``) train it as one process does
(plain SGD, exact); bucketed_ddp without it, the ZeRO names and DiLoCo refuse it naming what works (docs/errors.md).
Under manual optimization the FSDP2 family roots FSDP at each child network (lightscale/parallel/contract.py
``data_parallel_roots``), not at the LightningModule: a ``manual_backward`` inside the root's forward left every
gradient on the gathered parameters and the optimizers stepped shards without one (the weights never changed).
A model with one network child (``self.model``, already a root of its own) trains as one process does too, with two
``manual_backward`` calls accumulating into one step.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightscale
from lightscale.strategies import (
    BucketedDDPStrategy,
    DiLoCoStrategy,
    FSDP2Strategy,
    Parallel3DStrategy,
    ZeroStrategy,
)
from lightscale.testing import run_distributed

lightscale.patch_lightning()  # this process loads what the ranks trained, as a user's would

FAMILIES = {
    "bucketed_ddp": BucketedDDPStrategy,
    "fsdp2": FSDP2Strategy,
    "zero2": lambda: ZeroStrategy(stage=2),
    "zero3_offload": lambda: "zero3_offload",
    "parallel_3d": lambda: Parallel3DStrategy(dp=2),
    "diloco": lambda: DiLoCoStrategy(workers=2, sync_every=2),
}
STEPS, RESUMED_STEPS = 6, 8
LR = 0.2


class Classifier(pl.LightningModule):
    def __init__(self, width: int = 16, lr: float = LR) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 4))
        self.accuracy = MulticlassAccuracy(num_classes=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch[0])
        self.accuracy(logits, batch[1])
        self.log("val_loss", F.cross_entropy(logits, batch[1]), sync_dist=True)
        self.log("val_acc", self.accuracy)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", F.cross_entropy(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator))
    return DataLoader(data, batch_size=4)


def _trainer(root: Path, name: str, max_steps: int, saver: ModelCheckpoint, *, log_as: str = "") -> pl.Trainer:
    return lightscale.Trainer(
        strategy=FAMILIES[name](),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=max_steps,
        callbacks=[saver, EarlyStopping(monitor="val_loss", patience=20), LearningRateMonitor("step")],
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=0,
        logger=CSVLogger(root, name=log_as or name, version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _family(root: Path, name: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    directory = root / f"{name}_ckpt"
    saver = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=2, save_last=True)
    trainer = _trainer(root, name, STEPS, saver)
    model = Classifier()
    trainer.fit(model, _loader(), _loader())
    out: dict[str, Any] = {"best": saver.best_model_path, "last": saver.last_model_path, "step": trainer.global_step}
    out["kept"] = sorted(path.name for path in directory.iterdir() if path.name.endswith(".ckpt"))
    out["validate"] = trainer.validate(model, _loader(), ckpt_path="best")[0]
    out["test"] = trainer.test(model, _loader(), ckpt_path="last")[0]
    out["predicted"] = int(sum(len(batch) for batch in trainer.predict(model, _loader())))
    saver = ModelCheckpoint(dirpath=directory, save_last=True)
    resumed = _trainer(root, name, RESUMED_STEPS, saver, log_as=f"{name}_resumed")
    resumed.fit(Classifier(), _loader(), _loader(), ckpt_path="last")
    out["resumed_step"] = resumed.global_step
    return out


def _launch(root: Path) -> dict[str, Any]:
    return {name: _family(root, name) for name in FAMILIES}


class TwoOptimizers(pl.LightningModule):
    """A small GAN: the discriminator's step, then the generator's, each with its own SGD (manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = nn.Linear(8, 8), nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        generator, discriminator = self.optimizers()
        real = batch[0]
        fake = self.generator(real)
        loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        self.manual_backward(loss)
        discriminator.step()
        discriminator.zero_grad()
        self.manual_backward(F.softplus(-self.discriminator(self.generator(real))).mean())
        generator.step()
        generator.zero_grad()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.1),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.1),
        )


class OneNetwork(pl.LightningModule):
    """Manual optimization of one network child: two backward passes accumulate into one SGD step, and a forward
    without backward before the step (a sample to look at): the next step's forward must see the stepped weights,
    not the copy that forward gathered (FSDP roots reshard after forward under manual optimization)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(self.model(batch[0]).pow(2).mean())
        self.manual_backward((self.model(batch[0]) - 1).abs().mean())
        with torch.no_grad():
            self.model(batch[0])
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


GAN_STEPS = 3
MANUAL = {  # refusals last: they end their fit mid-way
    "fsdp2": lambda: FSDP2Strategy(meta_init=False),  # the weights the module was built with, as in one process
    "hsdp": lambda: FSDP2Strategy(dp_replicate=2, dp_shard=1, meta_init=False),
    "parallel_3d": lambda: Parallel3DStrategy(dp=2),
    "fsdp2_one_network": lambda: FSDP2Strategy(meta_init=False),
    "bucketed_ddp_find_unused": lambda: BucketedDDPStrategy(find_unused_parameters=True),
    "zero2": lambda: ZeroStrategy(stage=2),
    "diloco": lambda: DiLoCoStrategy(workers=2, sync_every=2),
    "bucketed_ddp": BucketedDDPStrategy,
}


def _gan_data() -> TensorDataset:
    """One global batch of 8, every epoch (the ranks split it): the same samples per step as one process."""
    return TensorDataset(torch.randn(8, 8, generator=torch.Generator().manual_seed(1)))


def _model_of(name: str) -> type[pl.LightningModule]:
    return OneNetwork if name.endswith("_one_network") else TwoOptimizers


def _manual(name: str) -> dict[str, torch.Tensor] | str:
    torch.manual_seed(0)
    model = _model_of(name)()
    trainer = lightscale.Trainer(
        strategy=MANUAL[name](),
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_epochs=GAN_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, DataLoader(_gan_data(), batch_size=8 // dist.get_world_size()))
    except Exception as error:  # the refusal is the result
        return f"{type(error).__name__}: {error}"
    state = model.state_dict()
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone() for k, v in state.items()}


def _manual_launch() -> dict[str, Any]:
    return {name: _manual(name) for name in MANUAL}


def manual_reference(model_class: type[pl.LightningModule]) -> dict[str, torch.Tensor]:
    """The same steps in this process, without a Trainer: the optimizers as built, backward as plain autograd."""
    torch.manual_seed(0)
    model = model_class()
    optimizers = model.configure_optimizers()
    model.optimizers = lambda: optimizers  # type: ignore[method-assign]
    model.manual_backward = lambda loss: loss.backward()  # type: ignore[method-assign]
    for _ in range(GAN_STEPS):
        model.training_step(_gan_data().tensors, 0)
    return model.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("features")
    results = run_distributed(_launch, root, world_size=2, timeout_s=400)[0]
    manual = run_distributed(_manual_launch, world_size=2, timeout_s=300)[0]
    return {"root": root, **results, "manual": manual}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_checkpoint_callback_validate_test_predict_and_resume(runs: dict[str, Any], name: str) -> None:
    run = runs[name]
    assert run["step"] == STEPS and run["resumed_step"] == RESUMED_STEPS
    assert "last.ckpt" in run["kept"] and len(run["kept"]) == 3, run["kept"]  # top 2 by val_loss, and last
    assert Path(run["best"]).name in run["kept"]
    assert set(run["validate"]) >= {"val_loss", "val_acc"} and 0 <= run["validate"]["val_acc"] <= 1
    assert torch.isfinite(torch.tensor(run["test"]["test_loss"]))
    assert run["predicted"] == 16  # this rank's half of 32 samples
    model = Classifier.load_from_checkpoint(run["best"])  # in this process: no process group
    assert not dist.is_initialized() and model.hparams.lr == LR


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logger_holds_the_step_wise_learning_rate_and_metrics(runs: dict[str, Any], name: str) -> None:
    with open(runs["root"] / name / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    rates = [float(row["lr-SGD"]) for row in rows if row.get("lr-SGD")]
    assert rates[:1] == [LR] and min(rates) == pytest.approx(LR * 0.5 ** ((STEPS - 1) // 2))
    assert any(row.get("val_acc") for row in rows) and any(row.get("train_loss") for row in rows)


@pytest.mark.parametrize("name", ["fsdp2", "hsdp", "parallel_3d", "fsdp2_one_network", "bucketed_ddp_find_unused"])
def test_manual_optimization_trains_as_one_process(runs: dict[str, Any], name: str) -> None:
    trained, reference = runs["manual"][name], manual_reference(_model_of(name))
    assert not isinstance(trained, str), trained
    for key, value in reference.items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("bucketed_ddp", r"received no gradient .*find_unused_parameters=True"),
        ("zero2", r"need exactly one optimizer.*run under BucketedDDPStrategy\(find_unused"),
        ("diloco", r"one inner optimizer per worker.*run under BucketedDDPStrategy\(find_unused"),
    ],
)
def test_two_optimizers_are_refused_naming_what_works(runs: dict[str, Any], name: str, message: str) -> None:
    assert isinstance(runs["manual"][name], str) and re.search(message, runs["manual"][name]), runs["manual"][name]
