"""A job restarts by itself after a rank is killed, and ends with the weights of an uninterrupted run (bitwise).

Real processes under ``torchrun --max-restarts 1``: rank 1 is SIGKILLed after step 10 of the first attempt,
torchrun restarts every rank, and ``--ckpt_path last`` resumes from the periodic checkpoint of step 8.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightscale.cli import main as lightscale_main

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
CONFIG = """
trainer:
  max_steps: 14
  val_check_interval: 100
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: ckpts, every_n_train_steps: 4, save_last: true, save_top_k: 0}}
    - class_path: lightscale.testing.KillOnce
      init_args: {{step: {kill_at}}}
"""


def _final_weights(strategy: str, kill_at: int, workdir: Path, cache: str) -> dict[str, torch.Tensor]:
    workdir.mkdir()
    (workdir / "extra.yaml").write_text(CONFIG.format(kill_at=kill_at))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    command = [*TORCHRUN, "--max-restarts", "1", "-m", "lightscale.cli", "fit", "--config", "gpt/tiny_ddp.yaml"]
    command += ["--config", "extra.yaml", "--trainer.strategy", strategy, "--ckpt_path", "last"]
    result = subprocess.run(
        command,
        cwd=workdir,
        env={**env, "LIGHTSCALE_CACHE": cache, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    killed = "exitcode: -9" in result.stderr
    assert killed == (kill_at < 14), "the fault must hit the first attempt, and only when planted"
    lightscale_main(["export", str(workdir / "ckpts/last.ckpt"), str(workdir / "final.pt")])
    return torch.load(workdir / "final.pt", weights_only=True)


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "fsdp2"])
def test_a_killed_rank_restarts_the_job_which_ends_as_if_never_killed(
    strategy: str, tmp_path: Path, corpus_cache: str
) -> None:
    restarted = _final_weights(strategy, 10, tmp_path / "killed", corpus_cache)
    uninterrupted = _final_weights(strategy, 10_000, tmp_path / "clean", corpus_cache)
    assert restarted.keys() == uninterrupted.keys()
    for name, tensor in restarted.items():
        assert torch.equal(tensor, uninterrupted[name]), name
