"""Lightning's everyday features under every strategy family, as a user combines them (a reduced matrix).

One launch of 2 gloo ranks runs, per family (bucketed_ddp, fsdp2, zero2, diloco), one fit of a classifier defined
here with everything at once: ``ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)``, ``EarlyStopping``,
``LearningRateMonitor`` on a step-wise ``StepLR``, gradient clipping, gradient accumulation, ``val_check_interval``,
a torchmetrics metric, a CSV logger; then ``validate(ckpt_path="best")``, ``test(ckpt_path="last")``, ``predict`` and
a resumed ``fit(ckpt_path="last")``. This process then loads the best checkpoint with ``load_from_checkpoint``.
"""

from __future__ import annotations

import csv
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
from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy, FSDP2Strategy, ZeroStrategy
from lightscale.testing import run_distributed

FAMILIES = {
    "bucketed_ddp": BucketedDDPStrategy,
    "fsdp2": FSDP2Strategy,
    "zero2": lambda: ZeroStrategy(stage=2),
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
        strategy=FAMILIES[name](), accelerator="cpu", devices=dist.get_world_size(), max_steps=max_steps,
        callbacks=[saver, EarlyStopping(monitor="val_loss", patience=20), LearningRateMonitor("step")],
        gradient_clip_val=1.0, accumulate_grad_batches=2, val_check_interval=2, num_sanity_val_steps=0,
        logger=CSVLogger(root, name=log_as or name, version=0), log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("features")
    return {"root": root, **run_distributed(_launch, root, world_size=2, timeout_s=400)[0]}


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
