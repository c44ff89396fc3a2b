"""MemoryProfiler on a GPU: an allocator snapshot for the chosen step (pytorch.org/memory_viz) and the memory/*
figures (skipped on machines without CUDA)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_snapshot_of_the_chosen_step(tmp_path: Path, corpus_cache: str) -> None:
    out = tmp_path / "memory"
    command = [sys.executable, "-m", "lightscale.cli", "fit", "--config", "gpt/tiny_ddp.yaml"]
    command += ["--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.max_steps", "3"]
    command += ["--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false"]
    command += ["--trainer.callbacks+=lightscale.callbacks.MemoryProfiler"]
    command += ["--trainer.callbacks.init_args.snapshot_steps=[1]", f"--trainer.callbacks.init_args.out_dir={out}"]
    env = {"LIGHTSCALE_CACHE": corpus_cache}
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**_env(), **env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "snapshot_step1_rank0.pickle").stat().st_size > 0
    assert (out / "memory.png").stat().st_size > 0


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
