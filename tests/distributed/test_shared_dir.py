"""Multi-node checkpoint directories: shared ones pass, node-local ones are refused naming what each node sees.

4 forked ranks play 2 nodes of 2 (``node = rank // 2``); each "node" runs in its own working directory for the
node-local case, so the same relative path names a different directory per node.
A fit on the same 4 ranks as 2 nodes (NODE_RANK, LOCAL_RANK) is refused at set-up, before its first step.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import TINY, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt import GPTModule
from lightscale.storage.shared_dir import check_shared_dir
from lightscale.testing import RankFailed, run_distributed


def _probe(root: str, layout: str) -> str:
    node, local = divmod(dist.get_rank(), 2)
    workdir = Path(root) / (f"node{node}" if layout == "node-local" else "shared")
    workdir.mkdir(exist_ok=True)
    os.chdir(workdir)  # the same relative path names a different directory on each "node"
    try:
        check_shared_dir(Path("ckpts"), node_rank=node, local_rank=local, num_nodes=2, wait_s=0.5)
    except ConfigurationError as error:
        return str(error)
    return "shared"


@pytest.mark.parametrize("layout", ["shared", "node-local"])
def test_node_local_checkpoint_dirs_are_refused(layout: str, tmp_path: Path) -> None:
    answers = run_distributed(_probe, str(tmp_path), layout, world_size=4, timeout_s=120)
    if layout == "shared":
        assert answers == ["shared"] * 4
    else:
        assert len(set(answers)) == 1  # every rank refuses, with the same message
        views = "(node 0 sees the markers of nodes [0]; node 1 sees the markers of nodes [1])"
        assert f"Checkpoint directory 'ckpts' is not shared by all 2 nodes {views}" in answers[0]
        assert "filesystem every node mounts" in answers[0]
    assert not [p for p in tmp_path.rglob(".lightscale_node*")]  # the markers are removed


def _fit_on_two_nodes(root: str, layout: str) -> None:
    """A lightscale fit on 2 "nodes" x 2 ranks with ModelCheckpoint(dirpath="ckpts"), node-local or shared."""
    node, local = divmod(dist.get_rank(), 2)
    os.environ.update(LOCAL_RANK=str(local), NODE_RANK=str(node), GROUP_RANK=str(node))
    workdir = Path(root) / (f"node{node}" if layout == "node-local" else "shared")
    workdir.mkdir(exist_ok=True)
    os.chdir(workdir)
    saver = ModelCheckpoint(dirpath="ckpts")
    trainer = quiet_trainer(
        "bucketed_ddp", devices=2, num_nodes=2, max_steps=1, enable_checkpointing=True, callbacks=[saver]
    )
    tokens = torch.randint(0, 256, (8, TINY.block_size + 1))
    trainer.fit(GPTModule(TINY), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1))


def test_a_fit_with_a_node_local_checkpoint_dir_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(RankFailed, match=r"Checkpoint directory '.*/ckpts' is not shared by all 2 nodes \(node 0 sees"):
        run_distributed(_fit_on_two_nodes, str(tmp_path), "node-local", world_size=4, timeout_s=120)
    assert not list(tmp_path.rglob("*.ckpt"))  # refused at setup, before the first step
    run_distributed(_fit_on_two_nodes, str(tmp_path), "shared", world_size=4, timeout_s=120)
    assert [p.name for p in tmp_path.rglob("*.ckpt")] == ["epoch=0-step=1.ckpt"]  # a shared one trains and saves
