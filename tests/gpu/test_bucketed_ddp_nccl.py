"""bucketed_ddp on NCCL: the same parity as on gloo, on 2 GPUs (skipped on machines without 2 CUDA devices)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_matches_single_gpu(tmp_path, corpus_cache: str) -> None:
    import subprocess
    import sys

    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "lightscale.cli", "fit"),
        *("--config", "gpt/tiny_ddp.yaml", "--trainer.accelerator", "gpu", "--trainer.max_steps", "10"),
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 rank(s), 10 steps" in result.stdout + result.stderr
