"""Checkpoints leave lightscale the way Lightning's documentation says they should: ``Model.load_from_checkpoint``,
Lightning's own Trainer (single device and ``ddp``) with ``ckpt_path``, and ``lightscale consolidate`` to one file
that Lightning loads in a process where lightscale cannot be imported.

One launch of 2 gloo ranks trains a user's model (``save_hyperparameters``, a buffer, SGD with momentum and a
step-wise ``StepLR``, one fixed global batch so the data position cannot matter) under every case below for
``STEPS`` steps, saving at ``SAVE_AT`` and snapshotting the full trained state there; in the same launch Lightning's
``ddp`` resumes the fsdp2 checkpoint. The checks then run in this process, which never initializes a process group:
    * weights: ``load_from_checkpoint`` gives the hyper-parameters and the trained weights bitwise (DiLoCo: its
      global model); ``map_location`` and ``strict`` are honoured;
    * resume: Lightning's single-device ``fit(ckpt_path=...)`` continues with the losses of the uninterrupted
      lightscale run (momentum buffers and the scheduler restored); where the checkpoint holds no optimizer state
      in torch's terms (DiLoCo, DeepSpeed's own directory) or the optimizer differs, a clear error;
    * consolidate: one file per checkpoint, loaded by ``load_from_checkpoint`` and resumed by ``fit`` in a Python
      without lightscale.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import dataclass
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

from lightscale.checkpoint.lightning_load import install_lightning_loading
from lightscale.cli import main as cli_main
from lightscale.commands.consolidate import consolidate
from lightscale.errors import ConfigurationError
from lightscale.strategies import BucketedDDPStrategy, DiLoCoStrategy, FSDP2Strategy, ZeroStrategy
from lightscale.strategies.registry import patch_lightning
from lightscale.testing import run_distributed

patch_lightning()  # this process only loads what the ranks trained, as a user's would (docs/plugins/checkpoint.md)

STEPS, SAVE_AT = 6, 4
GLOBAL_BATCH = 8
TOLERANCE = 1e-5  # relative, per step: 2 ranks vs one device differ only in the order of the gradient sums
HPARAMS = {"width": 12, "lr": 0.2, "label": "trained"}  # not the defaults: restoring them matters


class Net(pl.LightningModule):
    def __init__(self, width: int = 16, lr: float = 0.1, label: str = "default") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(8, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)) * self.scale)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class AdamNet(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH, 8, generator=generator), torch.randint(0, 4, (GLOBAL_BATCH,), generator=generator)


def loader(batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(*batch()), batch_size=batch_size)


@dataclass
class Case:
    name: str
    strategy: Any  # a factory
    # None: Lightning's fit restores the optimizer state; else the error and message fit(ckpt_path) raises
    refusal: tuple[type[Exception], str] | None = None


NO_STATE = (ConfigurationError, "cannot restore the optimizers")
CASES = [
    Case("bucketed_ddp", BucketedDDPStrategy),
    Case("bucketed_ddp_file", lambda: BucketedDDPStrategy(checkpoint_format="file")),
    Case("fsdp2", FSDP2Strategy),
    Case("zero3", lambda: ZeroStrategy(stage=3)),
    Case("zero2_deepspeed_dir", lambda: ZeroStrategy(stage=2, checkpoint_format="deepspeed"), NO_STATE),
    Case("diloco", lambda: DiLoCoStrategy(workers=2, sync_every=2), NO_STATE),
    Case(
        "diloco_file",
        lambda: DiLoCoStrategy(workers=2, sync_every=2, checkpoint_format="file"),
        (KeyError, "contains only the model"),
    ),
]
NAMES = [case.name for case in CASES]
# checkpoint_format="file" resumes under other strategies and world sizes: (name, factory, world size)
FILE_RESUMES = [
    ("fsdp2@2", FSDP2Strategy, 2),
    ("zero3@2", lambda: ZeroStrategy(stage=3), 2),
    ("fsdp2@1", FSDP2Strategy, 1),
]


# ---- the one launch --------------------------------------------------------------------------------------------
class SaveAndSnapshot(pl.Callback):
    """At step SAVE_AT: save the checkpoint and keep the full trained state (collective gathers)."""

    def __init__(self, path: Path) -> None:
        self.path, self.state = path, {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != SAVE_AT:
            return
        trainer.save_checkpoint(self.path)
        strategy = trainer.strategy
        if isinstance(strategy, DiLoCoStrategy):  # the checkpoint's model is the global one, not a worker's
            self.state = {f"model.{name}": t.detach().clone() for name, t in strategy.outer.named_globals()}
            buffers = dict(trainer.lightning_module.named_buffers())
            self.state |= {f"model.{name}": t.clone() for name, t in buffers.items()}
        else:
            live = zero_live_state(trainer) if isinstance(strategy, ZeroStrategy) else torch_live_state(trainer)
            self.state = {key: value for key, value in live.items() if key.startswith("model.")}
            if isinstance(strategy, ZeroStrategy):
                self.state |= {f"model.{k}": v.clone() for k, v in trainer.lightning_module.named_buffers()}


def _fit(strategy: Any, callbacks: list[pl.Callback], ckpt_path: str | None = None) -> list[float]:
    pl.seed_everything(0, verbose=False)
    losses = StepLosses()
    trainer = quiet_trainer(strategy, devices=dist.get_world_size(), max_steps=STEPS, callbacks=[losses, *callbacks])
    trainer.fit(Net(**HPARAMS), loader(GLOBAL_BATCH // dist.get_world_size()), ckpt_path=ckpt_path)
    return losses.steps


def _launch(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in CASES:
        saver = SaveAndSnapshot(root / f"{case.name}.ckpt")
        losses = _fit(case.strategy(), [saver])
        out[case.name] = {"losses": losses, "state": {k[len("model.") :]: v for k, v in saver.state.items()}}
    out["ddp_resumed"] = _fit("ddp", [], ckpt_path=str(root / "fsdp2.ckpt"))  # Lightning's own DDP
    return out | _resume_file(root, 2)


def _resume_file(root: Path, world_size: int) -> dict[str, list[float]]:
    file = str(root / "bucketed_ddp_file.ckpt")
    return {name: _fit(factory(), [], file) for name, factory, size in FILE_RESUMES if size == world_size}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("checkpoint_out")
    results = run_distributed(_launch, root, world_size=2, timeout_s=300)[0]
    one_rank = run_distributed(_resume_file, root, 1, world_size=1, timeout_s=120)[0]
    return {"root": root, **results, **one_rank}


def _path(trained: dict[str, Any], name: str) -> str:
    return str(trained["root"] / f"{name}.ckpt")


def _same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key].cpu(), value), key


def _plain_trainer(**kwargs: Any) -> pl.Trainer:
    """Lightning's own single-device Trainer (lightscale is imported but not used)."""
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return pl.Trainer(accelerator="cpu", devices=1, **(quiet | kwargs))


# ---- load_from_checkpoint --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_load_from_checkpoint_gives_hyperparameters_and_trained_weights(trained: dict[str, Any], name: str) -> None:
    assert not dist.is_initialized()
    model = Net.load_from_checkpoint(_path(trained, name))
    assert dict(model.hparams) == HPARAMS
    _same(model.state_dict(), trained[name]["state"])


def test_map_location_and_strict_are_honoured(trained: dict[str, Any]) -> None:
    calls: list[str] = []

    def on_cpu(storage: Any, location: str) -> Any:
        calls.append(location)
        return storage

    model = Net.load_from_checkpoint(_path(trained, "fsdp2"), map_location=on_cpu)
    assert calls and set(calls) == {"cpu"}
    _same(model.state_dict(), trained["fsdp2"]["state"])

    class Wider(Net):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.extra = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match=r"Missing key.*extra\.weight"):
        Wider.load_from_checkpoint(_path(trained, "zero3"))
    loose = Wider.load_from_checkpoint(_path(trained, "zero3"), strict=False)
    _same({k: v for k, v in loose.state_dict().items() if not k.startswith("extra.")}, trained["zero3"]["state"])


# ---- Lightning's own strategies --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_lightning_validate_reads_the_checkpoint(trained: dict[str, Any], name: str) -> None:
    metrics = _plain_trainer().validate(Net(**HPARAMS), loader(GLOBAL_BATCH), ckpt_path=_path(trained, name))
    reference = Net(**HPARAMS)
    reference.load_state_dict(trained[name]["state"])
    x, y = batch()
    assert metrics[0]["val_loss"] == pytest.approx(F.cross_entropy(reference(x), y).item(), rel=1e-6)


@pytest.mark.parametrize("name", [case.name for case in CASES if case.refusal is None])
def test_lightning_fit_resumes_with_the_optimizer_state(trained: dict[str, Any], name: str) -> None:
    losses = StepLosses()
    trainer = _plain_trainer(max_steps=STEPS, callbacks=[losses], limit_val_batches=0)
    trainer.fit(Net(**HPARAMS), loader(GLOBAL_BATCH), ckpt_path=_path(trained, name))
    expected = trained[name]["losses"][SAVE_AT:]
    assert len(losses.steps) == STEPS - SAVE_AT
    assert relative_difference(losses.steps, expected) <= TOLERANCE, (losses.steps, expected)


def test_lightning_ddp_resumes_an_fsdp2_checkpoint(trained: dict[str, Any]) -> None:
    expected = trained["fsdp2"]["losses"][SAVE_AT:]
    assert relative_difference(trained["ddp_resumed"], expected) <= TOLERANCE


@pytest.mark.parametrize("case", [case for case in CASES if case.refusal is not None], ids=lambda case: case.name)
def test_lightning_fit_refuses_a_checkpoint_without_optimizer_state(trained: dict[str, Any], case: Case) -> None:
    trainer = _plain_trainer(max_steps=STEPS, limit_val_batches=0)
    error, message = case.refusal
    with pytest.raises(error, match=message):
        trainer.fit(Net(**HPARAMS), loader(GLOBAL_BATCH), ckpt_path=_path(trained, case.name))


@pytest.mark.parametrize("name", [name for name, _, _ in FILE_RESUMES])
def test_a_single_file_resumes_under_other_strategies_and_world_sizes(trained: dict[str, Any], name: str) -> None:
    expected = trained["bucketed_ddp_file"]["losses"][SAVE_AT:]
    assert relative_difference(trained[name], expected) <= TOLERANCE, (trained[name], expected)


def test_checkpoint_format_file_writes_lightnings_own_file(trained: dict[str, Any]) -> None:
    for name in ("bucketed_ddp_file", "diloco_file"):
        path = trained["root"] / f"{name}.ckpt"
        assert path.is_file()
        saved = torch.load(path, weights_only=True)
        assert saved["hyper_parameters"] == HPARAMS and saved["global_step"] == SAVE_AT
        _same(saved["state_dict"], trained[name]["state"])
    assert len(torch.load(trained["root"] / "bucketed_ddp_file.ckpt", weights_only=True)["optimizer_states"]) == 1


def test_lightning_fit_refuses_another_optimizer(trained: dict[str, Any]) -> None:
    trainer = _plain_trainer(max_steps=STEPS, limit_val_batches=0)
    with pytest.raises(ConfigurationError, match="optimizer 0 is SGD in the checkpoint and Adam in this run"):
        trainer.fit(AdamNet(**HPARAMS), loader(GLOBAL_BATCH), ckpt_path=_path(trained, "bucketed_ddp"))


# ---- consolidate: one file, loaded without lightscale ----------------------------------------------------------
_NO_LIGHTSCALE = """
import importlib.util, json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "") + repr(f)]
sys.path[:] = [p for p in sys.path if "__editable__" not in p and "lightscale" not in p]
assert importlib.util.find_spec("lightscale") is None, "lightscale is importable"
import torch
import lightning.pytorch as pl
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from typing import Any
GLOBAL_BATCH, STEPS = {GLOBAL_BATCH}, {STEPS}
{source}

class Losses(pl.Callback):
    def __init__(self): self.steps = []
    def on_train_batch_end(self, trainer, module, outputs, *args): self.steps.append(float(outputs["loss"]))

root, names = sys.argv[1], sys.argv[2].split(",")
expected = torch.load(f"{{root}}/expected.pt", weights_only=True)
for name in names:
    model = Net.load_from_checkpoint(f"{{root}}/{{name}}.consolidated.ckpt")
    assert dict(model.hparams) == expected["hparams"], name
    for key, value in expected[name].items():
        assert torch.equal(model.state_dict()[key], value), (name, key)
losses = Losses()
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[losses], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Net(**expected["hparams"]), loader(GLOBAL_BATCH), ckpt_path=f"{{root}}/fsdp2.with_optimizer.ckpt")
print(json.dumps({{"lightscale": "lightscale" in sys.modules, "losses": losses.steps}}))
"""


def test_consolidated_files_load_in_lightning_without_lightscale(trained: dict[str, Any]) -> None:
    root = trained["root"]
    for name in NAMES:
        consolidate(_path(trained, name), root / f"{name}.consolidated.ckpt")
    cli_main(["consolidate", _path(trained, "fsdp2"), str(root / "fsdp2.with_optimizer.ckpt"), "--with-optimizer"])
    expected = {name: trained[name]["state"] for name in NAMES} | {"hparams": HPARAMS}
    torch.save(expected, root / "expected.pt")
    source = "\n\n".join(inspect.getsource(item) for item in (Net, batch, loader))
    script = root / "no_lightscale.py"
    script.write_text(_NO_LIGHTSCALE.format(GLOBAL_BATCH=GLOBAL_BATCH, STEPS=STEPS, source=source))
    command = [sys.executable, "-I", str(script), str(root), ",".join(NAMES)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["lightscale"] is False
    expected_losses = trained["fsdp2"]["losses"][SAVE_AT:]
    assert relative_difference(report["losses"], expected_losses) <= TOLERANCE, (report["losses"], expected_losses)


def test_consolidate_refuses_optimizer_state_it_cannot_give(trained: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"holds no optimizer state.*without --with-optimizer"):
        consolidate(_path(trained, "diloco"), tmp_path / "out.ckpt", with_optimizer=True)
    assert not (tmp_path / "out.ckpt").exists()


def test_installing_the_hook_again_keeps_one() -> None:
    import lightning.pytorch.core.saving as saving

    install_lightning_loading()  # lightscale.patch_lightning() and every lightscale strategy call it
    before = saving.pl_load
    install_lightning_loading()
    assert saving.pl_load is before
