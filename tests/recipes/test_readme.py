"""The README's code runs: every Python block and every shell command, on tiny settings, so none goes stale.

Python blocks run as scripts (Lightning re-launches them once per rank) with ``max_steps`` cut to 2. Shell lines
run with ``--trainer.max_steps 2`` added to ``fit``; ``make`` lines are left out (``make test`` is what runs this
file, ``make demo`` trains the small GPT for minutes). A ``lightscale`` line that launches no ranks (``strategies``,
``estimate``) runs in this process through the console script's own function, ``lightscale.cli.main``: a fresh
interpreter would add only its imports. Lines another test already runs as they stand (``RUN_ELSEWHERE``) run there.
The YAML block runs as a config file of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lightscale.cli import COMMANDS
from lightscale.cli import main as lightscale_main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FAST = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]
# README lines run, with a few steps added, by a test that checks more of their output; a line edited in the README
# no longer matches its key and runs here again.
RUN_ELSEWHERE = {
    "lightscale fit --config gpt/tiny_ddp.yaml": "tests/distributed/test_launch.py::test_cli_launches_its_own_ranks",
    "torchrun --nproc-per-node 2 -m lightscale.cli fit --config gpt/tiny_ddp.yaml": (
        "tests/distributed/test_launch.py::test_torchrun"
    ),
}


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _lines() -> list[list[str]]:
    """Each shell line as written, as argv (comments dropped)."""
    argvs = [shlex.split(line, comments=True) for block in _blocks("bash") for line in block.splitlines()]
    return [argv for argv in argvs if argv and argv[0] != "make"]


def _commands() -> list[list[str]]:
    """Each shell line this file runs as argv, with the ``lightscale`` console script run by this Python."""
    commands = []
    for argv in _lines():
        if " ".join(argv) in RUN_ELSEWHERE:
            continue
        if argv[0] == "lightscale":
            argv = [sys.executable, "-m", "lightscale.cli", *argv[1:]]
        elif argv[0] == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        if "fit" in argv:
            argv += FAST
        commands.append(argv)
    return commands


def _in_process(argv: list[str]) -> bool:
    """A ``lightscale`` subcommand that launches no ranks (everything but fit, validate, test, predict)."""
    return argv[1:3] == ["-m", "lightscale.cli"] and argv[3] in COMMANDS


def _run(argv: list[str], cwd: Path) -> None:
    launched = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # from a surrounding launcher
    env = {key: value for key, value in os.environ.items() if key not in launched} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def test_the_readme_has_code_to_run() -> None:
    assert len(_blocks("python")) >= 1 and len(_lines()) >= 4 and len(_blocks("yaml")) == 1
    assert any(_in_process(argv) for argv in _commands()) and any(not _in_process(argv) for argv in _commands())


def test_lines_run_elsewhere_name_a_test_that_runs_them() -> None:
    for line, where in RUN_ELSEWHERE.items():
        path, name = where.split("::")
        source = (ROOT / path).read_text()
        assert f"def {name}(" in source, where
        body = source.split(f"def {name}(")[1].split("\ndef ")[0]
        missing = [arg for arg in line.split()[1:] if f'"{arg}"' not in body]  # the test's command is the line's
        assert not missing, f"{where} no longer runs {line!r}: {missing} not in its command"


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index: int, tmp_path: Path) -> None:
    code = re.sub(r"max_steps=\d+", "max_steps=2", _blocks("python")[index])
    (tmp_path / "block.py").write_text(code)
    _run([sys.executable, "block.py"], tmp_path)


@pytest.mark.parametrize("argv", _commands(), ids=lambda argv: " ".join(argv[2:6]))
def test_shell_line_runs(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _in_process(argv):
        monkeypatch.chdir(tmp_path)
        lightscale_main(argv[3:])  # what the console script calls; an error raises SystemExit here
        return
    _run(argv, tmp_path)


def test_yaml_block_runs(tmp_path: Path) -> None:
    (tmp_path / "my.yaml").write_text(_blocks("yaml")[0])
    argv = [sys.executable, "-m", "lightscale.cli", "fit", "--config", "my.yaml", *FAST]
    _run([*argv, "--trainer.accelerator", "cpu", "--trainer.devices", "2"], tmp_path)
