"""One way to ask which ranks read different data: ``lightscale.data_shard()`` (a dataset, a DataLoader worker),
``data_shard(trainer)`` (a callback, a DataModule: the shard the strategy gives the sampler) and the process group
``batch_mesh`` (the contrastive gather) give the same split; nothing else reads ``distributed_sampler_kwargs``."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

import lightscale
from lightscale.parallel.mesh import ParallelDims, batch_mesh

ROOT = Path(__file__).resolve().parents[2] / "lightscale"


def _trainer(strategy: object) -> SimpleNamespace:
    return SimpleNamespace(strategy=strategy)


def test_a_trainer_gets_the_shard_its_strategy_gives_the_sampler() -> None:
    parallel = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 3})
    assert lightscale.data_shard(_trainer(parallel)) == lightscale.DataShard(index=3, count=4)


def test_a_strategy_that_shards_no_data_gives_one_shard() -> None:
    assert lightscale.data_shard(_trainer(SimpleNamespace())) == (0, 1)  # single device: no sampler kwargs


@pytest.mark.skipif(dist.is_initialized(), reason="builds meshes on torch's fake process group")
@pytest.mark.parametrize(
    "degrees",
    [
        {"dp_shard": 2, "tp": 2, "pp": 2},  # tp and pp ranks share a shard
        {"dp_replicate": 2, "dp_shard": 2, "cp": 2},  # HSDP: both dp axes shard the data, cp ranks share
        {"dp_shard": 2, "ep": 2, "tp": 2},  # expert-parallel ranks read their own
        {"dp_shard": 8},
    ],
)
def test_batch_mesh_is_the_data_shards(degrees: dict[str, int]) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims(8, **degrees)
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = batch_mesh(dims.build_mesh("cpu"))
            assert (mesh.get_local_rank(), mesh.size()) == (dims.data_rank(rank), dims.data_shards), rank
        finally:
            dist.destroy_process_group()


def test_only_the_strategies_and_data_shard_read_the_sampler_kwargs() -> None:
    readers = set()
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("strategies/") or relative == "data/data_shard.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            if name == "distributed_sampler_kwargs":
                readers.add(relative)
    assert not readers, f"ask lightscale.data_shard(trainer) instead: {sorted(readers)}"
