"""The wheel as pip users get it: built from the repository, installed into a fresh virtual environment that has
no DeepSpeed, it trains bucketed_ddp on 2 ranks, refuses a ZeRO name by naming the extra, and plans (`lightscale
plan`) without importing DeepSpeed.

The fresh environment borrows this one's installed packages (a folder of links, DeepSpeed and lightscale left
out) instead of downloading them again, so the test needs no network and stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = ("deepspeed", "lightscale", "__editable__", "_lightscale")

SCRIPT = """
import importlib.util, sys
import lightning as L, torch
import lightscale
from lightscale.errors import ConfigurationError

assert importlib.util.find_spec("deepspeed") is None, "DeepSpeed must be absent here"
assert "site-packages" in lightscale.__file__, lightscale.__file__
try:
    lightscale.Trainer(strategy="zero2", accelerator="cpu", devices=2)
except ConfigurationError as error:
    assert "lightscale[deepspeed]" in str(error), error
else:
    raise AssertionError("zero2 was accepted without DeepSpeed")

from lightscale.cli import main as cli

cli(["plan", "--config", "gpt/tiny_ddp.yaml", "--world-size", "8"])  # ZeRO rows marked as needing the extra
assert "deepspeed" not in sys.modules, "planning imported DeepSpeed"


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
trainer = lightscale.Trainer(
    strategy="bucketed_ddp", accelerator="cpu", devices=2, max_steps=3, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
if trainer.global_rank == 0:
    print("trained", trainer.global_step, "steps on", lightscale.__version__)
"""


def _run(*args: str | Path, cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what the fresh environment installed
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{args[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _borrowed_packages(into: Path) -> Path:
    """Links to this environment's packages, DeepSpeed and lightscale left out."""
    into.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(LEFT_OUT) and entry.suffix != ".pth":
            (into / entry.name).symlink_to(entry)
    return into


def test_wheel_installs_and_trains_without_deepspeed(tmp_path: Path) -> None:
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, ROOT)
    (wheel,) = tmp_path.glob("lightscale-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightscale/py.typed" in names
    assert "lightscale/recipes/gpt/configs/tiny_ddp.yaml" in names

    venv = tmp_path / "fresh"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "borrowed.pth").write_text(f"{_borrowed_packages(tmp_path / 'borrowed')}\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel)

    (tmp_path / "train.py").write_text(SCRIPT)
    out = _run(python, "train.py", cwd=tmp_path)
    assert "trained 3 steps" in out, out
