"""Loading a DCP checkpoint never runs code from it: payloads in ``.metadata`` or in a non-tensor entry are refused.

Each payload touches a marker file when unpickled; torch's own reader is shown to run it, ours never does.
"""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from lightscale.checkpoint.portable import _FLAT, TRAINER_STATE, load_sharded
from lightscale.cli import main as lightscale_main
from lightscale.storage.safe_dcp import UnsafeCheckpointError


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(path: Path, *, poison: Any = None) -> dict[str, torch.Tensor]:
    model, optimizer = _model_and_optimizer()
    model_state, optim_state = get_state_dict(model, [optimizer], options=_FLAT)
    if poison is not None:
        optim_state["param_groups.0.weight.lr"] = poison  # a non-tensor entry: DCP stores it pickled
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path), no_dist=True)
    torch.save({"epoch": 0}, path / TRAINER_STATE)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def _poison_metadata(path: Path, marker: Path) -> None:
    import pickle

    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def test_a_clean_checkpoint_round_trips(tmp_path: Path) -> None:
    saved = _save(tmp_path / "ckpt")
    model, optimizer = nn.Sequential(nn.Linear(4, 3)), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    load_sharded(tmp_path / "ckpt", model, [optimizer])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name])
    assert optimizer.param_groups[0]["lr"] == 0.1  # the non-tensor entry was read, weights-only


def test_torch_reader_runs_a_metadata_payload_ours_refuses_it(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt")
    marker = tmp_path / "payload_ran"
    _poison_metadata(tmp_path / "ckpt", marker)
    with pytest.raises(Exception):  # noqa: B017  torch unpickles the payload, then fails on what it returned
        dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert marker.exists()  # the threat is real
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match="pathlib"):
        load_sharded(tmp_path / "ckpt", nn.Sequential(nn.Linear(4, 3)), [])
    with pytest.raises(SystemExit, match="Refusing to read this checkpoint's DCP metadata"):
        lightscale_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), "--prefix", ""])
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def test_a_payload_in_a_non_tensor_entry_is_refused_on_resume(tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    _save(tmp_path / "ckpt", poison=Payload(marker))
    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(UnsafeCheckpointError, match=r"param_groups\.0\.weight\.lr"):
        load_sharded(tmp_path / "ckpt", model, [optimizer])
    assert not marker.exists()
