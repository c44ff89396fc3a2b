"""``lightscale consolidate`` of single Lightning files (``--raw`` included), in one process; the directory layouts,
written by real multi-rank runs, are tested in tests/distributed/test_checkpoint_out.py and test_weight_averaging.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from lightscale.commands.consolidate import consolidate_command
from lightscale.recipes.gpt import GPTConfig
from lightscale.storage.safe_io import load_weights_only

# In a fresh process: consolidate imports no recipe up front, yet reads a GPT file (its GPTConfig hyper-parameter
# allow-listed once the recipe's module is imported by its recorded path); a lightscale class that no module
# allow-lists is still refused.
_FRESH_PROCESS = """
import sys
from lightscale.storage.safe_dcp import UnsafeCheckpointError
from lightscale.commands.consolidate import consolidate
assert not [m for m in sys.modules if m.startswith("lightscale.recipes.")], "recipes imported up front"
consolidate(sys.argv[1], sys.argv[2])
print(sorted({".".join(m.split(".")[:3]) for m in sys.modules if m.startswith("lightscale.recipes.")}))
try:
    consolidate(sys.argv[3], sys.argv[2])
except UnsafeCheckpointError as error:
    print("refused:", error)
"""


def _lightning_file(path: Path, hyper_parameters: dict) -> Path:
    torch.save({"state_dict": {"model.weight": torch.ones(2)}, "hyper_parameters": hyper_parameters}, path)
    return path


def test_consolidate_imports_only_the_recipe_a_file_names(tmp_path: Path) -> None:
    from lightscale.layers.float8 import Float8Options  # a plain dataclass no module allow-lists

    gpt = _lightning_file(tmp_path / "gpt.ckpt", {"config": GPTConfig(n_layer=1, n_head=1, n_embd=8)})
    other = _lightning_file(tmp_path / "other.ckpt", {"float8": Float8Options()})
    out = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(gpt), str(tmp_path / "out.ckpt"), str(other)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    imported, refused = out.stdout.strip().splitlines()
    assert imported == "['lightscale.recipes.gpt']"
    assert refused.startswith(f"refused: Refusing to read {other}")
    loaded = load_weights_only(tmp_path / "out.ckpt")
    assert loaded["hyper_parameters"]["config"] == GPTConfig(n_layer=1, n_head=1, n_embd=8)


def test_raw_of_a_single_file_gives_the_raw_weights(tmp_path: Path) -> None:
    """A file in Lightning's WeightAveraging convention: ``state_dict`` the average, ``current_model_state`` raw."""
    average, raw = {"model.weight": torch.full((2,), 0.5)}, {"model.weight": torch.ones(2)}
    counter = {"n_averaged": torch.tensor(3)}
    source = tmp_path / "ema.ckpt"
    torch.save({"state_dict": average, "current_model_state": raw, "averaging_state": counter, "epoch": 1}, source)

    consolidate_command([str(source), str(tmp_path / "raw.ckpt"), "--raw"])
    consolidate_command([str(source), str(tmp_path / "both.ckpt")])

    plain = load_weights_only(tmp_path / "raw.ckpt")
    assert torch.equal(plain["state_dict"]["model.weight"], raw["model.weight"]) and plain["epoch"] == 1
    assert "current_model_state" not in plain and "averaging_state" not in plain
    both = load_weights_only(tmp_path / "both.ckpt")
    assert torch.equal(both["state_dict"]["model.weight"], average["model.weight"])
    assert torch.equal(both["current_model_state"]["model.weight"], raw["model.weight"])
