"""The README's code runs: every Python block and every shell command, on tiny settings, so none goes stale.

Python blocks run as scripts (Lightning re-launches them once per rank) with ``max_steps`` cut to 2. Shell lines
run with ``--trainer.max_steps 2`` added to ``fit``; ``make`` lines are left out (``make test`` is what runs this
file, ``make demo`` trains the small GPT for minutes). The YAML block runs as a config file of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
FAST = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _commands() -> list[list[str]]:
    """Each shell line as argv, with the ``lightscale`` console script run by this Python."""
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if not argv or argv[0] == "make":
                continue
            if argv[0] == "lightscale":
                argv = [sys.executable, "-m", "lightscale.cli", *argv[1:]]
            elif argv[0] == "torchrun":
                argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
            if "fit" in argv:
                argv += FAST
            commands.append(argv)
    return commands


def _run(argv: list[str], cwd: Path) -> None:
    launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # from a surrounding launcher
    env = {key: value for key, value in os.environ.items() if key not in launched} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_the_readme_has_code_to_run() -> None:
    assert len(_blocks("python")) >= 1 and len(_commands()) >= 4 and len(_blocks("yaml")) == 1


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index: int, tmp_path: Path) -> None:
    code = re.sub(r"max_steps=\d+", "max_steps=2", _blocks("python")[index])
    (tmp_path / "block.py").write_text(code)
    _run([sys.executable, "block.py"], tmp_path)


@pytest.mark.parametrize("argv", _commands(), ids=lambda argv: " ".join(argv[2:6]))
def test_shell_line_runs(argv: list[str], tmp_path: Path) -> None:
    _run(argv, tmp_path)


def test_yaml_block_runs(tmp_path: Path) -> None:
    (tmp_path / "my.yaml").write_text(_blocks("yaml")[0])
    argv = [sys.executable, "-m", "lightscale.cli", "fit", "--config", "my.yaml", *FAST]
    _run([*argv, "--trainer.accelerator", "cpu", "--trainer.devices", "2"], tmp_path)
