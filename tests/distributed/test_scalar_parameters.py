"""0-dimensional parameters (a learnable temperature such as OpenCLIP's ``logit_scale``) train under the sharding
strategies exactly as on one device, and every checkpoint keeps the shape ``[]`` the user wrote.

The model is what a user brings and cannot edit: a 0-dimensional ``logit_scale`` on the LightningModule (FSDP's
root) and a 0-dimensional ``gain`` in each repeated block (FSDP's units), trained with SGD + momentum. One launch of
2 gloo ranks runs every case: fit ``STEPS`` steps saving at ``SAVE_AT``, then a second fit resuming from that
checkpoint. This process (no process group) then checks, for each case:
    * the losses and the final weights equal one device's (Lightning's own single-device fit) within ``TOLERANCE``;
    * the resumed run ends bitwise where the uninterrupted one ends (the replicated values and momentum restored);
    * ``load_from_checkpoint`` and ``lightscale consolidate`` give the weights at the save, bitwise, with shape ``[]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from checkpoint_matrix import torch_live_state, zero_live_state
from helpers import StepLosses, quiet_trainer, relative_difference
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightscale.cli import main as cli_main
from lightscale.strategies import ZeroStrategy
from lightscale.strategies.registry import patch_lightning
from lightscale.testing import run_distributed

patch_lightning()  # this process loads what the ranks trained, as a user's would (docs/plugins/checkpoint.md)

STEPS, SAVE_AT = 4, 2
GLOBAL_BATCH = 8
# Relative, per step and per weight: 2 ranks and one device differ only in the order of fp32 gradient sums (a few
# ulp, ~1e-7 relative); momentum carries each step's difference into the next ones, a few steps stay within 1e-6.
TOLERANCE = 1e-6
NAMES = ["fsdp2", "hsdp", "zero1", "zero2", "zero3"]
SCALARS = ("logit_scale", "blocks.0.gain", "blocks.1.gain")


class GainBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.tensor(0.8))  # 0-dimensional, inside an FSDP unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gain * torch.tanh(self.linear(x))


class ScaledNet(pl.LightningModule):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(GainBlock(width) for _ in range(2))
        self.head = nn.Linear(width, 4)
        self.logit_scale = nn.Parameter(torch.tensor(0.5))  # 0-dimensional, on the LightningModule (FSDP's root)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.logit_scale.exp()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def loader(batch_size: int) -> DataLoader:
    """One fixed global batch (each step an epoch): the data position cannot matter to a resume."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randint(0, 4, (GLOBAL_BATCH,)))
    return DataLoader(data, batch_size=batch_size)


class Snapshots(pl.Callback):
    """Saves at ``SAVE_AT`` (when given a path) and keeps the full model state there and at the end (collective)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.saved: dict[str, torch.Tensor] = {}
        self.final: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.path is not None and trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.path)
            self.saved = _model_state(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final = _model_state(trainer)


def _model_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    live = zero_live_state(trainer) if isinstance(trainer.strategy, ZeroStrategy) else torch_live_state(trainer)
    return {key[len("model.") :]: value for key, value in live.items() if key.startswith("model.")}


def _fit(name: str, path: Path, *, resume: bool) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    snapshots = Snapshots(None if resume else path)
    losses = StepLosses()
    trainer = quiet_trainer(name, devices=dist.get_world_size(), max_steps=STEPS, callbacks=[losses, snapshots])
    trainer.fit(ScaledNet(), loader(GLOBAL_BATCH // dist.get_world_size()), ckpt_path=str(path) if resume else None)
    return {"losses": losses.steps, "saved": snapshots.saved, "final": snapshots.final}


def _launch(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in NAMES:
        path = root / f"{name}.ckpt"
        out[name] = _fit(name, path, resume=False)
        out[name]["resumed"] = _fit(name, path, resume=True)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("scalar_parameters")
    return {"root": root, **run_distributed(_launch, root, world_size=2, timeout_s=600)[0]}


@pytest.fixture(scope="module")
def one_device() -> dict[str, Any]:
    """Lightning's own single-device fit of the same model, data and optimizer."""
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    module = ScaledNet()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        callbacks=[losses],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(GLOBAL_BATCH))
    return {"losses": losses.steps, "final": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def _same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert loaded[key].shape == value.shape and torch.equal(loaded[key].cpu(), value.cpu()), key


def _scalars_have_the_users_shape(state: dict[str, torch.Tensor]) -> None:
    assert all(state[name].shape == torch.Size([]) for name in SCALARS), {n: state[n].shape for n in SCALARS}


@pytest.mark.parametrize("name", NAMES)
def test_trains_as_one_device(trained: dict[str, Any], one_device: dict[str, Any], name: str) -> None:
    assert relative_difference(trained[name]["losses"], one_device["losses"]) <= TOLERANCE
    final = trained[name]["final"]
    _scalars_have_the_users_shape(final)
    assert sorted(final) == sorted(one_device["final"])
    for key, expected in one_device["final"].items():
        error = (final[key] - expected).abs().max() / expected.abs().max()
        assert error <= TOLERANCE, (key, float(error))
    assert float(final["logit_scale"]) != 0.5  # the temperature learned


@pytest.mark.parametrize("name", NAMES)
def test_resume_ends_bitwise_where_the_uninterrupted_run_ends(trained: dict[str, Any], name: str) -> None:
    _same(trained[name]["resumed"]["final"], trained[name]["final"])
    assert trained[name]["resumed"]["losses"] == trained[name]["losses"][SAVE_AT:]


@pytest.mark.parametrize("name", NAMES)
def test_checkpoints_keep_the_users_shape(trained: dict[str, Any], name: str) -> None:
    assert not dist.is_initialized()
    path = trained["root"] / f"{name}.ckpt"
    saved = trained[name]["saved"]
    _scalars_have_the_users_shape(saved)
    _same(ScaledNet.load_from_checkpoint(path).state_dict(), saved)
    output = trained["root"] / f"{name}.consolidated.ckpt"
    cli_main(["consolidate", str(path), str(output)])
    _same(torch.load(output, weights_only=True)["state_dict"], saved)
