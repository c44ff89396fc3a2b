"""Two "nodes" of 2 ranks on localhost (two torchrun agents, static rendezvous) train exactly like 4 ranks on one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightscale.cli import main as lightscale_main
from lightscale.testing import free_port, torchrun_fork

pytestmark = pytest.mark.slow
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FIT = ["-m", "lightscale.cli", "fit", "--config", "gpt/tiny_ddp.yaml", "--config", "save_last.yaml"]
SAVE_LAST = """
trainer:
  max_steps: 6
  val_check_interval: 100
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {dirpath: ckpts, save_last: true, save_top_k: 0}
"""


def _env(cache: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return {**env, "LIGHTSCALE_CACHE": cache, "OMP_NUM_THREADS": "1"}


def _final_weights(workdir: Path) -> dict[str, torch.Tensor]:
    lightscale_main(["export", str(workdir / "ckpts/last.ckpt"), str(workdir / "final.pt")])
    return torch.load(workdir / "final.pt", weights_only=True)


def test_two_nodes_of_two_ranks_equal_one_node_of_four(
    tmp_path: Path, corpus_cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes, single = tmp_path / "nodes", tmp_path / "single"
    for workdir in (nodes, single):
        workdir.mkdir()
        (workdir / "save_last.yaml").write_text(SAVE_LAST)
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    rendezvous += ["--master-port", str(free_port())]
    agents = [
        subprocess.Popen(
            [*TORCHRUN, *rendezvous, "--node-rank", str(node), *FIT, "--trainer.num_nodes", "2"],
            cwd=nodes,
            env=_env(corpus_cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    for agent in agents:
        output, _ = agent.communicate(timeout=600)
        assert agent.returncode == 0, output[-3000:]
    # The reference, one node of 4: torchrun's own agent and rendezvous with the same command, its workers forked
    # from this process (seconds of imports fewer; tests/distributed/test_restart.py does the same).
    monkeypatch.setenv("LIGHTSCALE_CACHE", corpus_cache)
    with contextlib.chdir(single):
        torchrun_fork(lightscale_main, [*FIT[2:], "--trainer.devices", "4"], nproc=4, max_restarts=0)
    two_nodes, four_ranks = _final_weights(nodes), _final_weights(single)
    assert two_nodes.keys() == four_ranks.keys()
    for name, tensor in two_nodes.items():
        assert torch.equal(tensor, four_ranks[name]), name
