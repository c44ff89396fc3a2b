"""A user's streaming dataset that shards itself, under tp2, cp2, pp2 and ep2 on 2 gloo ranks.

Sharding by ``torch.distributed.get_rank()`` (what litdata, webdataset and ``split_dataset_by_node`` do) gives the
two ranks of one data shard different batches under tp / cp / pp: refused at the first step, on every rank, naming
the ranks, the group and the fix (also under ep2_tp2 on 4 ranks). Sharding by ``lightscale.data_shard()`` (read in
a DataLoader worker) trains like one process (plain SGD, losses step by step). Under ep2 each rank is its own data
shard, so both ways are right. A random augmentation drawn in the workers under ``seed_everything(workers=True)`` is
the same on both tp ranks (workers seeded by the data shard), and matches one process.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import SGD_LR, TINY, SGDGPTModule, StepLosses, quiet_trainer, relative_difference
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import lightscale
from lightscale.layers.moe import MoEConfig
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import RankFailed, run_distributed

STEPS = 3
BATCH = 4  # per data shard
TOLERANCE = 1e-5
CONFIG = dataclasses.replace(TINY, tie_weights=False)  # pp2: embedding and head on different stages
MOE = dataclasses.replace(CONFIG, moe=MoEConfig(n_experts=4, top_k=2, balance="bias"))
LAYOUTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}, "pp2": {"pp": 2}}


class TokenStream(IterableDataset):
    """(tokens, targets) windows of a repeating random sequence; each reader takes every ``count``-th window.

    ``by="rank"`` shards by the process group's rank, ``by="data_shard"`` by ``lightscale.data_shard()``; either way
    a DataLoader worker splits its reader's windows further. ``augment`` replaces one token of each window with a
    random one, drawn in the worker (seeded by Lightning under ``seed_everything(workers=True)``)."""

    def __init__(self, by: str, block_size: int = CONFIG.block_size, windows: int = 64, augment: bool = False) -> None:
        self.by, self.augment = by, augment
        pattern = torch.randint(0, 64, (97,), generator=torch.Generator().manual_seed(0))
        self.tokens = pattern.repeat((windows * block_size) // 97 + 2)
        self.block_size, self.windows = block_size, windows

    def __iter__(self):
        if self.by == "rank":
            index, count = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        else:
            index, count = lightscale.data_shard()
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        for window in range(index, self.windows, count)[worker_id::workers]:
            start = window * self.block_size
            chunk = self.tokens[start : start + self.block_size + 1].clone()
            if self.augment:
                chunk[torch.randint(0, self.block_size, ())] = torch.randint(0, 64, ())
            yield chunk[:-1], chunk[1:]


def _fit(strategy: Any, *, by: str, batch: int, moe: bool = False, augment: bool = False) -> list[float]:
    pl.seed_everything(1234, workers=augment, verbose=False)  # workers=True: what LightningCLI (lightscale fit) sets
    module = SGDGPTModule(MOE if moe else CONFIG, sgd_lr=SGD_LR)
    losses = StepLosses()
    trainer = quiet_trainer(strategy, devices=dist.get_world_size(), max_steps=STEPS, callbacks=[losses])
    trainer.fit(module, DataLoader(TokenStream(by, augment=augment), batch_size=batch, num_workers=1))
    return losses.steps


def _references() -> dict[str, list[float]]:
    return {
        "dense": _fit("auto", by="rank", batch=BATCH),
        "moe": _fit("auto", by="rank", batch=2 * BATCH, moe=True),
        "augmented": _fit("auto", by="rank", batch=BATCH, augment=True),
    }


def _by_data_shard() -> dict[str, list[float]]:
    # Named "<reference>/<layout>": the one-process run each must match.
    runs = {
        f"dense/{name}": _fit(Parallel3DStrategy(**degrees), by="data_shard", batch=BATCH)
        for name, degrees in LAYOUTS.items()
    }
    for by in ("data_shard", "rank"):  # ep2: every rank is its own data shard, so its rank is right too
        runs[f"moe/ep2/{by}"] = _fit(Parallel3DStrategy(ep=2), by=by, batch=BATCH, moe=True)
    # Workers seeded under seed_everything(workers=True): by the data shard, so both tp ranks draw the same tokens.
    runs["augmented/tp2"] = _fit(Parallel3DStrategy(tp=2), by="data_shard", batch=BATCH, augment=True)
    return runs


def test_sharding_by_data_shard_trains_like_one_process() -> None:
    reference = run_distributed(_references, world_size=1)[0]
    runs = run_distributed(_by_data_shard, world_size=2, timeout_s=600)[0]
    for name, losses in runs.items():
        expected = reference[name.split("/")[0]]
        assert relative_difference(losses, expected) <= TOLERANCE, (name, losses, expected)
    assert reference["dense"][-1] < reference["dense"][0]  # it trains: the comparison is not vacuous


@pytest.mark.parametrize("layout", [*LAYOUTS, "ep2_tp2"])
def test_sharding_by_rank_is_refused(layout: str) -> None:
    # One launch each: a refused run ends its ranks (the failure watcher may end a peer before it raises itself).
    # ep2_tp2 on 4 ranks: 2 data shards (the ep ranks), each read by a tp pair; by rank, each rank reads its own.
    degrees, ranks = ({"ep": 2, "tp": 2}, 4) if layout == "ep2_tp2" else (LAYOUTS[layout], 2)
    axis = layout[:2] if layout != "ep2_tp2" else "tp"
    started = time.monotonic()
    with pytest.raises(RankFailed) as error:
        strategy = Parallel3DStrategy(**degrees)
        run_distributed(_fit, strategy, by="rank", batch=BATCH, moe="ep" in degrees, world_size=ranks, timeout_s=300)
    assert time.monotonic() - started < 120  # stopped, not timed out in a collective
    message = str(error.value)
    assert (
        "ConfigurationError: Ranks that share a data shard were given different batches at training step 0" in message
    )
    group = {"tp": "tensor", "cp": "context", "pp": "pipeline"}[axis]
    assert f"ranks [0, 1] of a {group}-parallel group ({axis}), data shard 0" in message
    assert "lightscale.data_shard()" in message
