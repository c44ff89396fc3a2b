"""Multi-node checkpoint directories: shared ones pass, node-local ones are refused naming what each node sees.

4 forked ranks play 2 nodes of 2 (``node = rank // 2``); each "node" runs in its own working directory for the
node-local case, so the same relative path names a different directory per node.
The end-to-end refusal through two torchrun agents (one cwd per "node") is in test_multinode.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

from lightscale.errors import ConfigurationError
from lightscale.plugins.shared_dir import check_shared_dir
from lightscale.testing import run_distributed


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
