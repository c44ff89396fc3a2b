"""A default run of every packaged tiny config prints no warning a user cannot act on (issue 22, item 5).

Each config runs through the CLI in a subprocess for 2 steps (``lightscale fit --config <recipe>/tiny_*.yaml
--trainer.max_steps 2``), in a temporary directory, with its own logger and checkpoints; every line of stdout and
stderr that looks like a warning must match one entry of ``ALLOWED``, each with the reason it stays. The same list
is in docs/architecture.md ("Logs").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "lightscale" / "recipes"
CONFIGS = sorted(f"{p.parents[1].name}/{p.name}" for p in RECIPES.glob("*/configs/tiny_*.yaml"))  # gpt/tiny_ddp.yaml
# A line is warning-like if it names a warning, a deprecation, or has Python's "file.py:LINE: message" form.
WARNING_LIKE = re.compile(r"warn|deprecat|\.py:\d+: ", re.IGNORECASE)
# pattern -> why the line stays (empty: nothing is left)
ALLOWED: dict[str, str] = {}


def _warnings(output: str) -> list[str]:
    lines = (line.strip() for chunk in output.splitlines() for line in chunk.split("\r"))
    return [line for line in lines if WARNING_LIKE.search(line) and "it/s" not in line]  # not the progress bar


def _unexplained(lines: list[str]) -> list[str]:
    return [line for line in lines if not any(re.search(pattern, line) for pattern in ALLOWED)]


def _command(config: str) -> list[str]:
    """The CLI, under torchrun when the config wants more processes than this machine has cores (tiny_3d: as its
    header says); otherwise Lightning starts the processes itself."""
    devices = yaml.safe_load((RECIPES / config.replace("/", "/configs/")).read_text())["trainer"]["devices"]
    launch = [sys.executable]
    if devices > (os.cpu_count() or 1):
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(devices)]
    return [*launch, "-m", "lightscale.cli", "fit", "--config", config, "--trainer.max_steps", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_tiny_config_prints_no_warning_the_user_cannot_act_on(config: str, tmp_path: Path, corpus_cache: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "LIGHTSCALE_CACHE": corpus_cache}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run(_command(config), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lightscale run summary" in done.stderr + done.stdout  # it did train
    assert _unexplained(_warnings(done.stdout + done.stderr)) == []


def test_the_filter_sees_warnings() -> None:
    output = (
        "/x/lightning/pytorch/core/module.py:1333: Seems like `optimizer.step()` has been overridden\n"
        "[2026-01-01] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n"
        "Epoch 0:  50%|█████     | 1/2 [00:00<00:00, 10.85it/s]\rGPU available: False, used: False\n"
    )
    assert len(_warnings(output)) == 2
