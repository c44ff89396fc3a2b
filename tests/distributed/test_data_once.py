"""Every sample exactly once per epoch per data-parallel group, for a user's own DataLoader, under every strategy.

The dataset is the test's own map-style Dataset: sample ``i`` is a token window whose first token is ``i``, so a
callback records which samples each rank trained on. Ranks of one data-parallel group (tp, pp, cp) must see the same
samples; different groups (dp, ep) disjoint ones; together every sample once (the remainder under a pipeline is
dropped with a warning naming how many).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, StopAfter, quiet_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightscale.data.sampler import ExactlyOnceSampler
from lightscale.errors import ConfigurationError
from lightscale.layers.moe import MoEConfig
from lightscale.recipes.gpt import GPTModule
from lightscale.strategies import Parallel3DStrategy
from lightscale.testing import RankFailed, run_distributed

SAMPLES = 22  # 4 data-parallel ranks x batch 2: 2 full steps + 6 left (one short step); 2 ranks: 5 + 2 left
BATCH = 2
PIPELINED = dataclasses.replace(TINY, n_layer=4, tie_weights=False)
MOE = dataclasses.replace(TINY, moe=MoEConfig(n_experts=4, top_k=2, balance="bias"))


class NumberedWindows(Dataset):
    """Sample ``i``: tokens ``[i, 1, 2, ...]`` and their next-token targets; ``i`` is the sample id."""

    def __init__(self, size: int, block_size: int) -> None:
        self.size, self.block_size = size, block_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.arange(self.block_size + 1) % 200 + 1
        tokens[0] = index
        return tokens[:-1], tokens[1:]


class RecordIds(pl.Callback):
    """The sample ids of every training batch this rank ran, per epoch."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}
        self.val_ids: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.ids.setdefault(trainer.current_epoch, []).extend(batch[0][:, 0].tolist())

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, *_: Any) -> None:
        self.val_ids.extend(batch[0][:, 0].tolist())


def _fit(
    strategy: Any,
    config: Any,
    *,
    epochs: int = 1,
    callbacks: list[pl.Callback] | tuple = (),
    ckpt_path: str | None = None,
    validate: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    pl.seed_everything(7, verbose=False)
    recorder = RecordIds()
    loader = DataLoader(NumberedWindows(SAMPLES, config.block_size), batch_size=BATCH, shuffle=True)
    val = DataLoader(NumberedWindows(SAMPLES, config.block_size), batch_size=BATCH) if validate else None
    if validate:
        kwargs["limit_val_batches"] = 1.0
    trainer = quiet_trainer(
        strategy,
        devices=dist.get_world_size(),
        max_steps=-1,
        max_epochs=epochs,
        callbacks=[recorder, *callbacks],
        **kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            GPTModule(config, learning_rate=1e-3, warmup_steps=1), loader, val_dataloaders=val, ckpt_path=ckpt_path
        )
    dropped = [str(w.message) for w in caught if "dropped every epoch" in str(w.message)]
    dp = trainer.strategy.distributed_sampler_kwargs
    return {"ids": recorder.ids, "val_ids": recorder.val_ids, "dp": dp, "dropped": dropped}


def _every_family() -> dict[str, dict[str, Any]]:
    return {
        "bucketed_ddp": _fit("bucketed_ddp", TINY),
        "zero2": _fit("zero2", TINY),
        "fsdp2": _fit("fsdp2", TINY, validate=True),
        "tp2": _fit(Parallel3DStrategy(tp=2), TINY),
        "pp2": _fit(Parallel3DStrategy(pp=2), PIPELINED),
        "ep2": _fit(Parallel3DStrategy(dp=2, ep=2), MOE),
        "cp2": _fit(Parallel3DStrategy(dp=2, cp=2), TINY),  # the cp ranks of a data shard read the same samples
    }


def _check_exactly_once(runs: list[dict[str, Any]], *, dropped: int = 0) -> None:
    by_group: dict[int, list[int]] = {}
    for run in runs:
        ids = run["ids"][0]
        group = run["dp"]["rank"]
        assert by_group.setdefault(group, ids) == ids, "ranks of one data-parallel group saw different samples"
    seen = Counter(i for ids in by_group.values() for i in ids)
    assert max(seen.values()) == 1, f"seen twice: {[i for i, n in seen.items() if n > 1]}"
    assert len(seen) == SAMPLES - dropped, f"skipped: {sorted(set(range(SAMPLES)) - set(seen))}"
    assert len(by_group) == runs[0]["dp"]["num_replicas"]
    assert bool(runs[0]["dropped"]) == bool(dropped)


def test_every_sample_once_under_every_family() -> None:
    results = run_distributed(_every_family, world_size=4, timeout_s=600)
    for name in ("bucketed_ddp", "zero2", "fsdp2", "tp2", "ep2", "cp2"):
        _check_exactly_once([rank[name] for rank in results])
    # A pipeline runs one batch shape: 22 = 5 global batches of 2 x 2 dp groups + 2, dropped with a warning.
    _check_exactly_once([rank["pp2"] for rank in results], dropped=2)
    assert "2 of 22 samples are dropped every epoch" in results[0]["pp2"]["dropped"][0]
    # Validation too (no shuffle, no resume skip): every sample once over the 4 data-parallel ranks.
    assert sorted(i for rank in results for i in rank["fsdp2"]["val_ids"]) == list(range(SAMPLES))


def test_sampler_splits_the_remainder_and_refuses_empty_batches() -> None:
    # 11 = 2 global batches of 2 x 2 + 3 left: ranks take 2 and 1 of them, so both run 3 steps.
    shards = [ExactlyOnceSampler(range(11), batch_size=2, num_replicas=2, rank=r) for r in range(2)]
    assert [list(s) for s in shards] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10]]
    assert [len(s) for s in shards] == [6, 5]
    shards[0].resume_from(0, 2)
    assert list(shards[0]) == [8, 9]
    shards[0].set_epoch(1)
    assert list(shards[0]) == [0, 1, 4, 5, 8, 9]  # the skip applies to the resumed epoch only
    with pytest.raises(ConfigurationError, match="9 samples leaves 1 after the full global batches of 4"):
        ExactlyOnceSampler(range(9), batch_size=2, num_replicas=2, rank=0)
    dropping = ExactlyOnceSampler(range(9), batch_size=2, num_replicas=2, rank=1, drop_remainder=True)
    assert (list(dropping), dropping.dropped) == ([2, 3, 6, 7], 1)


def _stopped_and_resumed(strategy: str, checkpoint_dir: str) -> dict[int, list[int]]:
    """Stop after 3 of an epoch's 6 steps (ModelCheckpoint wrote the checkpoint, as before a kill), resume, finish
    2 epochs; return the ids trained on per epoch over both runs."""
    saver = ModelCheckpoint(dirpath=checkpoint_dir, filename=strategy, every_n_train_steps=3, save_top_k=-1)
    first = _fit(strategy, TINY, epochs=2, callbacks=[saver, StopAfter(3)], enable_checkpointing=True)
    second = _fit(strategy, TINY, epochs=2, ckpt_path=f"{checkpoint_dir}/{strategy}.ckpt")
    return {epoch: first["ids"].get(epoch, []) + second["ids"].get(epoch, []) for epoch in (0, 1)}


def _resume_each(checkpoint_dir: str) -> dict[str, dict[int, list[int]]]:
    return {name: _stopped_and_resumed(name, checkpoint_dir) for name in ("bucketed_ddp", "zero2", "fsdp2")}


def test_mid_epoch_resume_keeps_the_data_position(tmp_path) -> None:
    results = run_distributed(_resume_each, str(tmp_path), world_size=2, timeout_s=600)
    for name in ("bucketed_ddp", "zero2", "fsdp2"):
        for epoch in (0, 1):
            per_rank = [rank[name][epoch] for rank in results]
            seen = Counter(i for ids in per_rank for i in ids)
            assert sorted(seen) == list(range(SAMPLES)) and max(seen.values()) == 1, (name, epoch, per_rank)
        assert len(results[0][name][0]) == len(results[0][name][1])  # the resumed epoch is no shorter
    # The same checkpoints resumed by a wider model (on one rank: DCP reshards): refused naming the key and both
    # shapes, before any step.
    wider = dataclasses.replace(TINY, n_embd=64)
    for name, where in (("fsdp2", "fsdp2.ckpt"), ("zero2", "zero2.ckpt"), ("bucketed_ddp", "bucketed_ddp.ckpt")):
        with pytest.raises(
            RankFailed, match=rf"{where}.* differently shaped model: .*checkpoint \(256, 32\), model \(256, 64\)"
        ):
            run_distributed(_fit, name, wider, ckpt_path=str(tmp_path / f"{name}.ckpt"), world_size=1, timeout_s=300)
