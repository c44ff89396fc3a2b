"""The real launch paths, as separate processes: Lightning's own launcher (``lightscale fit`` starting its
second rank) and ``torchrun``. Slower than the forked tests, so only a few steps each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import unexplained_warnings

pytestmark = pytest.mark.slow
LIGHTSCALE = [sys.executable, "-m", "lightscale.cli"]
FEW_STEPS = ["--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.enable_progress_bar", "false"]


def _run(command: list[str], cwd: Path, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LIGHTSCALE_CACHE": cache, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    # 900 s: on a fresh environment the first ZeRO-offload run JIT-builds DeepSpeed's CPU Adam.
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, _failure_report(result)
    return result


def _failure_report(result: subprocess.CompletedProcess) -> str:
    """Each rank's own error lines first: torchrun's summary at the end of stderr names only the signal."""
    markers = ("Error", "Traceback", "terminate", "abort", "Signal", "lightscale: ending")
    errors = [line for line in result.stderr.splitlines() if any(marker in line for marker in markers)]
    return "\n".join(errors[:80]) + "\n--- stdout tail ---\n" + result.stdout[-2000:]


def test_cli_launches_its_own_ranks(tmp_path: Path, corpus_cache: str) -> None:
    result = _run([*LIGHTSCALE, "fit", "--config", "gpt/tiny_ddp.yaml", *FEW_STEPS], tmp_path, corpus_cache)
    output = result.stdout + result.stderr
    assert "lightscale run summary (BucketedDDPStrategy, 2 rank(s), 6 steps)" in output
    assert "rank 1:" in output
    assert list((tmp_path / "runs/gpt/tiny_ddp").rglob("events.out.tfevents.*")), "TensorBoard logs written"
    assert unexplained_warnings(output) == []  # tests/recipes/test_quiet_logs.py's check of this config


def test_torchrun(tmp_path: Path, corpus_cache: str) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "lightscale.cli"]
    result = _run([*torchrun, "fit", "--config", "gpt/tiny_ddp.yaml", *FEW_STEPS], tmp_path, corpus_cache)
    assert "2 rank(s), 6 steps" in result.stdout + result.stderr


def test_validate_subcommand(tmp_path: Path, corpus_cache: str) -> None:
    result = _run([*LIGHTSCALE, "validate", "--config", "gpt/tiny_ddp.yaml"], tmp_path, corpus_cache)
    assert "val/loss" in result.stdout + result.stderr


def test_zero3_offload_from_yaml(tmp_path: Path, corpus_cache: str) -> None:
    result = _run([*LIGHTSCALE, "fit", "--config", "gpt/tiny_zero3_offload.yaml", *FEW_STEPS], tmp_path, corpus_cache)
    assert "lightscale run summary (ZeroStrategy, 2 rank(s), 6 steps)" in result.stdout + result.stderr
    assert unexplained_warnings(result.stdout + result.stderr) == []  # as in tests/recipes/test_quiet_logs.py


def test_parallel_3d_under_torchrun_on_8_processes(tmp_path: Path, corpus_cache: str) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8", "-m", "lightscale.cli"]
    # 3 steps, one validation at step 3: 8 processes share 2 cores here, and each step costs seconds
    steps = [*FEW_STEPS[:1], "3", *FEW_STEPS[2:]]
    result = _run([*torchrun, "fit", "--config", "gpt/tiny_3d.yaml", *steps], tmp_path, corpus_cache)
    assert "lightscale run summary (Parallel3DStrategy, 8 rank(s), 3 steps)" in result.stdout + result.stderr
    assert unexplained_warnings(result.stdout + result.stderr) == []  # as in tests/recipes/test_quiet_logs.py
