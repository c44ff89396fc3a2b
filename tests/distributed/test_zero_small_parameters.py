"""ZeRO resumes a model whose parameters the ranks do not divide: a user's MLP ending in ``nn.Linear(32, 1)`` (a
1-element bias, smaller than the world) and an odd 3-wide hidden layer (3 elements on 2 ranks), trained with SGD and
momentum under every ZeRO name, saved mid-run by ModelCheckpoint and resumed with ``fit(ckpt_path=...)``, on local
disk and in ``s3://`` (the local S3 server of tests/conftest.py).

ZeRO-3 pads each parameter's partition to ``ceil(numel / ranks)``: on 2 ranks the 1-element bias is rank 0's element
and rank 1's padding. DeepSpeed's ``set_full_hp_param`` narrows past the end of such a parameter, so the load failed
("start (1) + length (1) exceeds dimension size (1)") and the failure report named the run's stage, "[train, step
0]", instead of the restore.

Each case runs once uninterrupted (saving at ``SAVED_AT`` and at the end) and once resumed from the mid-run save:
the resumed losses and its final checkpoint (weights and momentum buffers) equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import S3_BUCKET, StepLosses, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightscale.checkpoint.lightning_format import lightning_checkpoint
from lightscale.testing import RankFailed, run_distributed

STEPS, SAVED_AT = 6, 3
SAMPLES = 8  # one global batch: every step sees every sample, so only the checkpoint can change a resumed run


class Net(pl.LightningModule):
    """A user's regressor: a 3-wide hidden layer (3-element bias, 96- and 3-element weights) and a 1-output head."""

    def __init__(self, hidden: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader(ranks: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=SAMPLES // ranks)


def _fit(strategy: str, dirpath: str, *, ckpt_path: str | None = None, hidden: int = 3) -> list[float]:
    """Fit ``Net`` to ``STEPS`` under ``strategy`` (a registered name, its defaults), saving every ``SAVED_AT``
    steps to ``dirpath``; the loss of every step."""
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    saver = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer = quiet_trainer(
        strategy,
        devices=dist.get_world_size(),
        max_steps=STEPS,
        callbacks=[losses, saver],
        enable_checkpointing=True,
    )
    trainer.fit(Net(hidden), _loader(dist.get_world_size()), ckpt_path=ckpt_path)
    return losses.steps


def _resume_equals_uninterrupted(strategy: str, whole_dir: str, resumed_dir: str, world_size: int) -> None:
    ranks: dict[str, Any] = {"world_size": world_size, "timeout_s": 300}
    whole = run_distributed(_fit, strategy, whole_dir, **ranks)[0]
    mid = f"{whole_dir}/step={SAVED_AT}.ckpt"
    resumed = run_distributed(_fit, strategy, resumed_dir, ckpt_path=mid, **ranks)[0]
    assert resumed == whole[SAVED_AT:]  # bitwise: every loss after the resume
    end = f"step={STEPS}.ckpt"
    expected, actual = (lightning_checkpoint(f"{d}/{end}", optimizer=True) for d in (whole_dir, resumed_dir))
    _assert_equal(actual["state_dict"], expected["state_dict"])
    assert len(actual["optimizer_states"]) == len(expected["optimizer_states"]) == 1
    momentum = [s["momentum_buffer"] for s in actual["optimizer_states"][0]["state"].values()]
    assert [m.numel() for m in momentum] == [256, 32, 96, 3, 3, 1]  # the 1- and 3-element ones included
    _assert_equal(actual["optimizer_states"][0]["state"], expected["optimizer_states"][0]["state"])


def _assert_equal(actual: dict[Any, Any], expected: dict[Any, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_equal(actual[key], value)
        else:
            assert torch.equal(torch.as_tensor(actual[key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("strategy", ["zero3", "zero1", "zero2", "zero3_offload"])
def test_resume_with_parameters_smaller_than_the_world_is_bitwise(strategy: str, tmp_path: Path) -> None:
    _resume_equals_uninterrupted(strategy, str(tmp_path / "whole"), str(tmp_path / "resumed"), world_size=2)


def test_zero3_on_four_ranks(tmp_path: Path) -> None:
    """4 ranks: the 3-element parameters leave rank 3 only padding, the 1-element bias ranks 1-3."""
    _resume_equals_uninterrupted("zero3", str(tmp_path / "whole"), str(tmp_path / "resumed"), world_size=4)


def test_zero3_resume_from_s3_is_bitwise(s3: str) -> None:
    url = f"s3://{S3_BUCKET}/zero-small"
    _resume_equals_uninterrupted("zero3", f"{url}/whole", f"{url}/resumed", world_size=2)
    fsspec.filesystem("s3").rm(url, recursive=True)


def test_a_failed_restore_is_reported_as_the_restore(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A checkpoint of another model (a 4-wide hidden layer) fails to load: the report names the restore and the
    checkpoint, not the stage about to run ("[train, step 0]")."""
    ranks: dict[str, Any] = {"world_size": 2, "timeout_s": 300}
    run_distributed(_fit, "zero3", str(tmp_path / "other"), hidden=4, **ranks)
    mid = str(tmp_path / "other" / f"step={SAVED_AT}.ckpt")
    with pytest.raises(RankFailed):
        run_distributed(_fit, "zero3", str(tmp_path / "resumed"), ckpt_path=mid, **ranks)
    err = capfd.readouterr().err
    assert f"[fit, restoring the checkpoint {mid}]" in err, err[-3000:]
    assert "[train, step 0]" not in err
