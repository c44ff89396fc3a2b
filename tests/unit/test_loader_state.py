"""Stream positions in one process: each data shard takes its own loader state back, and a stream's saved state is
the one after the batches trained, not after Lightning's look-ahead (the 2-rank resume is
tests/distributed/test_stream_resume.py)."""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

from lightscale.data.data_shard import DataShard, forget_data_shard, publish_data_shard
from lightscale.data.loader_position import (
    TrainedPosition,
    gather_loader_states,
    maybe_track_trained_position,
    take_own_loader_state,
)


class Counting:
    """A stateful stream of ``n`` batches: its state is how many it has handed out."""

    def __init__(self, n: int) -> None:
        self.n, self.handed = n, 0

    def __iter__(self):
        while self.handed < self.n:
            self.handed += 1
            yield self.handed - 1

    def state_dict(self) -> dict[str, Any]:
        return {"handed": self.handed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.handed = state["handed"]


def checkpoint_with(states: list[dict[str, Any]]) -> dict[str, Any]:
    return {"loops": {"fit_loop": {"state_dict": {"combined_loader": states}}}}


@pytest.fixture
def shard():
    def publish(index: int, count: int) -> None:
        publish_data_shard(DataShard(index, count), rank=0, world_size=1)

    yield publish
    forget_data_shard()


def test_each_data_shard_takes_its_own_state(shard) -> None:
    shard(1, 2)
    assert gather_loader_states(checkpoint_with([{"handed": 5}])) == [{"shard": (1, 2), "state": [{"handed": 5}]}]
    assert gather_loader_states(checkpoint_with([])) is None  # no stateful loader: nothing saved
    saved = [{"shard": (0, 2), "state": [{"handed": 3}]}, {"shard": (1, 2), "state": [{"handed": 7}]}]
    trainer_state = {**checkpoint_with([{"handed": 3}]), "lightscale": {"loaders": saved}}  # rank 0 wrote it
    take_own_loader_state(trainer_state)
    assert trainer_state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"handed": 7}]


def test_another_shard_count_keeps_rank_0s_state_with_a_warning(shard) -> None:
    shard(0, 3)
    saved = [{"shard": (0, 2), "state": [{"handed": 3}]}, {"shard": (1, 2), "state": [{"handed": 7}]}]
    trainer_state = {**checkpoint_with([{"handed": 3}]), "lightscale": {"loaders": saved}}
    with pytest.warns(UserWarning, match=r"loader positions for \[2\] data shards and this run reads 3"):
        take_own_loader_state(trainer_state)
    assert trainer_state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"handed": 3}]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 5])
def test_saved_position_is_that_of_the_batches_trained(stop_after: int) -> None:
    stream = maybe_track_trained_position(Counting(5), training=True)
    assert isinstance(stream, TrainedPosition)
    fetcher = _PrefetchDataFetcher()  # Lightning's: reads a loader without len one batch ahead
    fetcher.setup(stream)
    iter(fetcher)
    trained = [next(fetcher) for _ in range(stop_after)]
    assert stream.state_dict() == {"handed": stop_after}, trained  # resumed, batch `stop_after` comes next
    stream.worker_init_fn = print  # what Lightning sets on a loader lands on the wrapped one
    assert stream.loader.worker_init_fn is print and stream.n == 5


def test_sized_or_stateless_loaders_stay_as_they_are() -> None:
    sized = [1, 2, 3]
    assert maybe_track_trained_position(sized, training=True) is sized
    stream = Counting(2)
    assert maybe_track_trained_position(stream, training=False) is stream  # evaluation loaders are not saved
