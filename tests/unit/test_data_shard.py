"""``lightscale.data_shard()`` and the batch agreement check in one process: what the strategy publishes, what a
worker inherits, the fallbacks; checksums, the groups compared, the steps checked."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import lightscale
from lightscale.data.batch_agreement import BatchAgreement, batch_checksum, disagreements
from lightscale.data.data_shard import COUNT_VARIABLE, INDEX_VARIABLE, VARIABLES, publish_data_shard
from lightscale.errors import ConfigurationError
from lightscale.parallel.mesh import ParallelDims


@pytest.fixture
def clean_env():
    with mock.patch.dict(os.environ):
        for name in VARIABLES:
            os.environ.pop(name, None)
        yield


def test_without_a_strategy_or_process_group_one_shard(clean_env) -> None:
    assert lightscale.data_shard() == lightscale.DataShard(index=0, count=1)


def test_published_shard_is_read_without_a_process_group(clean_env) -> None:
    # A spawned DataLoader worker: no process group, the environment inherited from its rank.
    publish_data_shard(lightscale.DataShard(3, 4), rank=6, world_size=8)
    assert lightscale.data_shard() == (3, 4)


@pytest.mark.parametrize(
    ("degrees", "shards"),
    [
        # world 8: tp2 x dp4 -> ranks (0,1) share shard 0; pp2 x tp2 x dp2: stages and tp ranks share theirs
        ({"dp_shard": 4, "tp": 2}, [0, 0, 1, 1, 2, 2, 3, 3]),
        ({"dp_shard": 2, "tp": 2, "pp": 2}, [0, 0, 1, 1, 0, 0, 1, 1]),
        ({"dp_shard": 2, "ep": 2, "cp": 2}, [0, 0, 1, 1, 2, 2, 3, 3]),  # ep ranks read their own batches
        ({"dp_shard": 4, "ep": 2}, list(range(8))),
    ],
)
def test_shards_are_dp_times_ep(degrees, shards) -> None:
    dims = ParallelDims(world_size=8, **degrees)
    assert [dims.data_rank(rank) for rank in range(8)] == shards
    assert dims.data_shards == dims.dp * dims.ep == max(shards) + 1


def test_bad_published_values_are_refused(clean_env) -> None:
    os.environ[INDEX_VARIABLE], os.environ[COUNT_VARIABLE] = "2", "2"
    with pytest.raises(ConfigurationError, match=r"LIGHTSCALE_DATA_SHARD_INDEX='2'.*0 <= index < count"):
        lightscale.data_shard()
    with pytest.raises(ConfigurationError, match="not in range"):
        publish_data_shard(lightscale.DataShard(1, 1), rank=0, world_size=1)


def test_checksum_tells_batches_apart() -> None:
    tokens = torch.arange(12).reshape(3, 4)
    same = batch_checksum((tokens, tokens + 1))
    assert torch.equal(same, batch_checksum([tokens.clone(), tokens + 1]))  # containers do not matter, values do
    with_nan = {"x": torch.tensor([float("nan"), 1.0])}
    assert torch.equal(batch_checksum(with_nan), batch_checksum({"x": with_nan["x"].clone()}))  # NaN != NaN, still
    others = [
        (tokens.flip(0), tokens + 1),  # the same samples in another order
        (tokens + 1, tokens),  # tensors swapped
        (tokens[:2], tokens[:2] + 1),  # a shorter batch
        (tokens,),  # a tensor missing
    ]
    assert all(not torch.equal(same, batch_checksum(other)) for other in others)


def test_disagreements_name_the_group_of_each_axis() -> None:
    dims = ParallelDims(world_size=8, dp_shard=2, cp=2, tp=2)  # shards: ranks 0-3 and 4-7
    agreeing = torch.tensor([[float(dims.data_rank(rank))] * 4 for rank in range(8)], dtype=torch.float64)
    assert disagreements(agreeing, dims) == []
    by_rank = torch.arange(8, dtype=torch.float64)[:, None].expand(8, 4)
    assert disagreements(by_rank, dims) == [("tp", [0, 1]), ("cp", [0, 2])]
    one_off = agreeing.clone()
    one_off[6] += 1  # rank 6: tp group [6, 7] and cp group [4, 6] of shard 1
    assert disagreements(one_off, dims) == [("tp", [6, 7]), ("cp", [4, 6])]


def test_check_runs_at_the_first_step_and_every_n() -> None:
    agreement = BatchAgreement(ParallelDims(world_size=1), every=3)
    assert not agreement.needed  # one rank per data shard: nothing to compare, no collective
    tp = BatchAgreement(ParallelDims(world_size=2, tp=2), every=3)
    checked = []
    with mock.patch(
        "lightscale.data.batch_agreement.all_gather_single",
        lambda out, local: checked.append(tp.steps - 1) or out.copy_(local.repeat(2)),
    ):
        for _ in range(7):
            tp.maybe_check(torch.ones(2), device=torch.device("cpu"))
    assert checked == [0, 3, 6]
    with pytest.raises(ConfigurationError, match="check_batches_every=True"):
        BatchAgreement(ParallelDims(world_size=1), every=True)
    assert not BatchAgreement(ParallelDims(world_size=2, tp=2), every=None).needed


@pytest.mark.parametrize(
    ("strategy", "shards"), [("tp2", [(0, 1), (0, 1)]), ("ep2", [(0, 2), (1, 2)]), ("fsdp2", [(0, 2), (1, 2)])]
)
def test_the_trainer_publishes_the_shard_when_constructed(clean_env, strategy, shards) -> None:
    # Each rank as Lightning's launcher starts it (LOCAL_RANK): the shard is known before fit, with no process group.
    for local_rank, shard in enumerate(shards):
        with mock.patch.dict(os.environ, LOCAL_RANK=str(local_rank)):
            lightscale.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
            assert lightscale.data_shard() == shard


def test_a_shard_published_for_another_process_group_is_not_read(clean_env) -> None:
    # Published by rank 0 of 2 (say, a harness's parent process), read in a process group of 1 rank: not its own.
    publish_data_shard(lightscale.DataShard(0, 2), rank=0, world_size=2)
    with mock.patch("torch.distributed.is_initialized", return_value=True):
        with (
            mock.patch("torch.distributed.get_rank", return_value=0),
            mock.patch("torch.distributed.get_world_size", return_value=1),
        ):
            assert lightscale.data_shard() == (0, 1)
        with (
            mock.patch("torch.distributed.get_rank", return_value=0),
            mock.patch("torch.distributed.get_world_size", return_value=2),
        ):
            assert lightscale.data_shard() == (0, 2)  # its own (a forked DataLoader worker sees the same group)


def test_a_trainer_without_a_lightscale_strategy_forgets_the_shard(clean_env) -> None:
    lightscale.Trainer(strategy="ep2", accelerator="cpu", devices=2, logger=False)
    assert lightscale.data_shard() == (0, 2)
    lightscale.Trainer(accelerator="cpu", devices=1, logger=False)
    assert lightscale.data_shard() == (0, 1)
