"""bucketed_ddp on NCCL reproduces one GPU step by step, with plain SGD and the gloo tests' bound
(tests/distributed/test_parity.py); skipped on machines without 2 CUDA devices.

Real processes under torchrun, as a user launches them: 2 ranks with 4 samples each against 1 rank with the whole
batch of 8; each rank's own loss (before any reduction) is written, and their mean per step is compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import PARITY_TOLERANCE, relative_difference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]
TESTS = Path(__file__).resolve().parents[1]
STEPS = 10
GLOBAL_BATCH = 8

SCRIPT = """
import json, os, sys
from helpers import SGD_LR, train_tiny_gpt

strategy, devices, cache_dir, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
losses = train_tiny_gpt(
    strategy, devices=devices, batch_size={batch} // devices, max_steps={steps}, cache_dir=cache_dir,
    sgd_lr=SGD_LR, local_losses=True, accelerator="gpu",
)
with open(os.path.join(out, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(losses, f)
"""


def _losses(strategy: str, devices: int, folder: Path, corpus_cache: str) -> list[float]:
    """Mean over ranks of each rank's own step losses, from a torchrun launch of ``devices`` GPUs."""
    script = folder / "train.py"
    script.write_text(SCRIPT.format(batch=GLOBAL_BATCH, steps=STEPS))
    out = folder / f"{strategy}_{devices}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices)]
    command += [str(script), strategy, str(devices), corpus_cache, str(out)]
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(devices)]
    assert all(len(losses) == STEPS for losses in per_rank)
    return [sum(step) / len(step) for step in zip(*per_rank, strict=True)]


def test_nccl_matches_single_gpu(tmp_path: Path, corpus_cache: str) -> None:
    reference = _losses("auto", 1, tmp_path, corpus_cache)
    nccl = _losses("bucketed_ddp", 2, tmp_path, corpus_cache)
    assert relative_difference(nccl, reference) <= PARITY_TOLERANCE, (nccl, reference)
    assert reference[-1] < reference[0] - 1.0  # it learned: the comparison is not vacuous
