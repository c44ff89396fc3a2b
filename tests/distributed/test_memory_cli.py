"""``lightscale fit ... --trainer.callbacks+=lightscale.callbacks.MemoryProfiler`` (a real launch: Lightning starts
the second rank) leaves the ``memory/*`` TensorBoard scalars and the timeline PNG."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_fit_with_memory_profiler_writes_scalars_and_png(tmp_path: Path, corpus_cache: str) -> None:
    env = {**os.environ, "LIGHTSCALE_CACHE": corpus_cache, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    command = [sys.executable, "-m", "lightscale.cli", "fit", "--config", "gpt/tiny_ddp.yaml"]
    command += ["--trainer.callbacks+=lightscale.callbacks.MemoryProfiler", "--trainer.max_steps", "4"]
    command += ["--trainer.log_every_n_steps", "2", "--trainer.limit_val_batches", "0"]
    command += ["--trainer.enable_progress_bar", "false"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (png,) = (tmp_path / "runs").rglob("memory/memory.png")
    assert png.stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(png.parent.parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"memory/parameters", "memory/activations", "memory/rank1/optimizer", "memory/estimate/activations"}
    assert expected <= tags
