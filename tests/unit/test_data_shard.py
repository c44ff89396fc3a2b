"""``lightscale.data_shard()`` in one process: what the strategy publishes, what a worker inherits, the fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest

import lightscale
from lightscale.errors import ConfigurationError
from lightscale.parallel.data_shard import COUNT_VARIABLE, INDEX_VARIABLE, publish_data_shard
from lightscale.parallel.mesh import ParallelDims


@pytest.fixture
def clean_env():
    with mock.patch.dict(os.environ):
        os.environ.pop(INDEX_VARIABLE, None)
        os.environ.pop(COUNT_VARIABLE, None)
        yield


def test_without_a_strategy_or_process_group_one_shard(clean_env) -> None:
    assert lightscale.data_shard() == lightscale.DataShard(index=0, count=1)


def test_published_shard_is_read_here_and_in_a_child_process(clean_env) -> None:
    publish_data_shard(lightscale.DataShard(3, 4))
    assert lightscale.data_shard() == (3, 4)
    code = "import lightscale; print(tuple(lightscale.data_shard()))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "(3, 4)"  # a spawned DataLoader worker inherits the environment the same way


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
        publish_data_shard(lightscale.DataShard(1, 1))
