"""``lightscale convert`` and ``export``: every format round-trips bitwise into the single-device GPT (tied weights
included), bad targets fail before any work, payload checkpoints are refused without running, writes are atomic."""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
from helpers import TINY
from safetensors.torch import load_file
from torch import nn

import lightscale.checkpoint.convert
from lightscale.checkpoint import convert as convert_module
from lightscale.checkpoint.convert import convert, read_model_state
from lightscale.checkpoint.portable import TRAINER_STATE, load_sharded
from lightscale.cli import main
from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt import GPT


class Payload:
    """Touches ``marker`` when unpickled: proof that a load ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY)  # ties the token embedding and the output head


def _lightning_ckpt(model: nn.Module, path: Path, **extra: object) -> Path:
    """What Lightning's single-file save writes for a LightningModule holding the GPT as ``model``."""
    state = {f"model.{key}": value for key, value in model.state_dict().items()}
    torch.save({"state_dict": state, "pytorch-lightning_version": lightning.__version__, **extra}, path)
    return path


def _assert_same(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    expected = model.state_dict()
    assert sorted(state) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), key


def test_every_format_round_trips_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _gpt()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    main(["convert", str(tmp_path / "plain.pt"), str(tmp_path / "gpt.safetensors")])  # torch -> safetensors
    main(["convert", str(tmp_path / "gpt.safetensors"), str(tmp_path / "portable.ckpt")])  # -> dcp (suffix)
    main(["convert", str(tmp_path / "portable.ckpt"), str(tmp_path / "back"), "--to", "torch"])  # dcp -> torch
    assert "wrote" in capsys.readouterr().out

    fresh = GPT(TINY)
    fresh.load_state_dict(load_file(tmp_path / "gpt.safetensors"))  # strict, tied weights stored under both names
    _assert_same(fresh.state_dict(), model)
    assert fresh.output.weight is fresh.tok_embeddings.weight
    _assert_same(torch.load(tmp_path / "back", weights_only=True), model)
    # The dcp output is the layout's "model" part, LightningModule keys, plus a trainer state naming its origin.
    assert (tmp_path / "portable.ckpt" / ".metadata").is_file()
    meta = torch.load(tmp_path / "portable.ckpt" / TRAINER_STATE, weights_only=True)
    assert meta["lightscale"] == {"format": 1, "strategy": "lightscale convert", "world_size": 1}
    holder = nn.Module()
    holder.model = GPT(TINY)
    load_sharded(tmp_path / "portable.ckpt", holder, [])  # the reader strategies resume with
    _assert_same(holder.model.state_dict(), model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "gpt.safetensors", "plain.pt", "portable.ckpt"]


def test_lightning_ckpt_exports_safetensors_by_default_and_torch_for_pt(tmp_path: Path) -> None:
    model = _gpt()
    _lightning_ckpt(model, tmp_path / "last.ckpt", epoch=3)
    main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "gpt.safetensors")])
    main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "gpt.pt")])
    main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "weights"), "--format", "safetensors"])
    _assert_same(load_file(tmp_path / "gpt.safetensors"), model)
    _assert_same(load_file(tmp_path / "weights"), model)
    _assert_same(torch.load(tmp_path / "gpt.pt", weights_only=True), model)


def test_bad_targets_fail_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--to 'onnx' is not a conversion target; valid: \['safetensors', 'torch'"):
        main(["convert", str(tmp_path / "missing.ckpt"), str(tmp_path / "out"), "--to", "onnx"])
    with pytest.raises(SystemExit, match=r"--format 'dcp' is not an export format; valid: \['safetensors', 'torch'\]"):
        main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "out"), "--format", "dcp"])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["convert", str(tmp_path / "missing.ckpt"), str(tmp_path / "out.safetensors")])
    with pytest.raises(ConfigurationError, match="neither a Lightning checkpoint"):
        torch.save([torch.zeros(1)], tmp_path / "list.pt")
        read_model_state(tmp_path / "list.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.pt"]


def test_a_failed_safetensors_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.save(_gpt().state_dict(), tmp_path / "plain.pt")
    convert(tmp_path / "plain.pt", tmp_path / "gpt.safetensors")
    before = (tmp_path / "gpt.safetensors").read_bytes()

    def dies_mid_write(state: dict, path: str, metadata: dict) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(lightscale.checkpoint.convert, "save_file", dies_mid_write)
    with pytest.raises(OSError, match="disk full"):
        convert(tmp_path / "plain.pt", tmp_path / "gpt.safetensors")
    assert (tmp_path / "gpt.safetensors").read_bytes() == before  # the previous export, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt.safetensors", "plain.pt"]


@pytest.mark.parametrize("kind", ["dcp_metadata", "torch_file", "lightning_ckpt"])
@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_payload_is_refused_and_never_runs(kind: str, command: str, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    source = tmp_path / "in.ckpt"
    if kind == "dcp_metadata":
        torch.save(_gpt().state_dict(), tmp_path / "plain.pt")
        convert(tmp_path / "plain.pt", source, target="dcp")
        (source / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    elif kind == "torch_file":
        torch.save({"weight": torch.zeros(2), "trap": Payload(marker)}, source)
    else:
        _lightning_ckpt(_gpt(), source, hyper_parameters={"config": Payload(marker)})
    with pytest.raises(SystemExit, match="Refusing to read"):
        main([command, str(source), str(tmp_path / "out.safetensors")])
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()
    if kind == "dcp_metadata":
        pickle.loads((source / ".metadata").read_bytes())
    else:
        torch.load(source, weights_only=False)
    assert marker.exists()  # the payload is real: an unrestricted load runs it


def test_sources_are_detected(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigurationError, match="neither a DCP checkpoint"):
        convert_module.detect_source(tmp_path / "dir")
    (tmp_path / "dir" / "checkpoint").mkdir()
    assert convert_module.detect_source(tmp_path / "dir") == "deepspeed"
