"""An exception the user's script catches around ``trainer.fit`` on every rank (Optuna's pruning, ``pytest.raises``)
is the script's: no traceback, no "lightscale: rank 0 raised", no rank ended, exit code 0. Caught on one rank only,
the other rank (waiting for it in a collective) is still told and ends, naming the failing rank.

Real processes: ``python train.py`` under Lightning's launcher (rank 0 starts rank 1), 2 ranks on gloo.
docs/faults.md ("An error the script handles").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import os
import torch
import lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightscale

RAISING = os.environ["RAISING"]  # "every" rank, or rank "0" only


class Pruned(Exception):  # what optuna.TrialPruned is to a script
    pass


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, index):
        if index == 2 and (RAISING == "every" or self.global_rank == int(RAISING)):
            raise Pruned(f"trial pruned at step {{index}}")
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = lightscale.Trainer(
    strategy="{strategy}", accelerator="cpu", devices=2, max_steps=6, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
try:
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
except Pruned as error:
    print(f"handled on rank {{trainer.global_rank}}: {{error}}", flush=True)
    if RAISING == "every":
        trainer.strategy.barrier()  # the ranks go on together, as the next trial's fit would
"""


def _run(tmp_path: Path, strategy: str, raising: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(strategy=strategy))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1", "RAISING": raising, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=400,
    )


@pytest.mark.parametrize("strategy", ["bucketed_ddp", "fsdp2"])
def test_an_exception_every_rank_raises_and_the_script_catches_is_left_to_it(tmp_path: Path, strategy: str) -> None:
    result = _run(tmp_path, strategy, "every")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"handled on rank {rank}: trial pruned at step 2" in result.stdout, result.stdout
    assert "Traceback" not in result.stderr and "lightscale:" not in result.stderr, result.stderr[-3000:]
    assert "[rank" not in result.stderr, result.stderr[-3000:]


def test_caught_on_one_rank_the_rank_waiting_for_it_is_still_told(tmp_path: Path) -> None:
    result = _run(tmp_path, "bucketed_ddp", "0")
    assert "handled on rank 0: trial pruned at step 2" in result.stdout, result.stdout
    summary = "rank 0 raised Pruned: trial pruned at step 2 [train, step 2]"
    assert f"lightscale: ending rank 1 because {summary}" in result.stderr, result.stderr[-3000:]
    assert f"lightscale: {summary}" in result.stderr and '[rank0]:   File "' in result.stderr  # where it was raised
    assert "handled on rank 1" not in result.stdout
