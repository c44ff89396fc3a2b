"""The hook into Lightning's loading (lightscale/checkpoint/lightning_load.py), in one process without a process group:
a lightscale directory loads through ``load_from_checkpoint`` and never runs code from its files; other paths reach
Lightning's own loader untouched. (Directories written by real strategies: tests/distributed/test_checkpoint_out.py.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightscale
from lightscale.checkpoint.portable import write_checkpoint
from lightscale.storage.safe_dcp import UnsafeCheckpointError
from lightscale.storage.safe_io import save_atomically

lightscale.patch_lightning()  # what a process that only loads calls (lightscale/strategies/registry.py)


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 2)


class _Payload:
    """Unpickling this runs ``touch MARKER``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def _directory(path: Path, hyper_parameters: dict[str, Any]) -> dict[str, torch.Tensor]:
    weights = {f"layer.{k}": v for k, v in nn.Linear(hyper_parameters.get("width", 3), 2).state_dict().items()}
    rest = {"hyper_parameters": hyper_parameters, "pytorch-lightning_version": pl.__version__}
    write_checkpoint(path, {"model": weights}, rest, lambda data, file: save_atomically(data, Path(file)))
    return weights


def test_a_directory_loads_through_load_from_checkpoint(tmp_path: Path) -> None:
    weights = _directory(tmp_path / "last.ckpt", {"width": 5})
    model = Tiny.load_from_checkpoint(tmp_path / "last.ckpt")
    assert model.hparams.width == 5
    assert all(torch.equal(model.state_dict()[key], value) for key, value in weights.items())


def test_a_payload_in_the_trainer_state_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _directory(tmp_path / "bad.ckpt", {"width": 3, "evil": _Payload(marker)})
    with pytest.raises(UnsafeCheckpointError, match=r"Refusing to read .*trainer_state\.pt"):
        Tiny.load_from_checkpoint(tmp_path / "bad.ckpt")
    assert not marker.exists()
    torch.load(tmp_path / "bad.ckpt" / "trainer_state.pt", weights_only=False)  # the unrestricted load runs it
    assert marker.exists()


def test_single_files_still_go_through_lightnings_loader(tmp_path: Path) -> None:
    module = Tiny(width=4)
    saved = {"state_dict": module.state_dict(), "hyper_parameters": {"width": 4}, "pytorch-lightning_version": "2.6.0"}
    torch.save(saved, tmp_path / "one.ckpt")
    loaded = Tiny.load_from_checkpoint(tmp_path / "one.ckpt")
    assert torch.equal(loaded.layer.weight, module.layer.weight)
