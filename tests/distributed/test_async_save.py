"""Async save (``async_save=True``): the checkpoints, the losses and a resume are bitwise those of synchronous
saving, and a rank killed while its shards are written in the background leaves the previous checkpoint.

Three launches of the tiny GPT under fsdp2 on 2 ranks, saving at steps 2 and 4 while training goes on to step 5:
synchronous (the reference), async with rank 1 killed in the step-4 write (``last.ckpt`` overwritten), and an
async resume from what the killed run left, saving at steps 3 and 4 (the second into the first's staging buffers),
whose step-4 save is still in flight when fit ends (teardown waits).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import train_tiny_gpt
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightscale.errors import ConfigurationError
from lightscale.storage.safe_dcp import SafeFileSystemReader, load_safely
from lightscale.strategies import FSDP2Strategy
from lightscale.strategies.deepspeed.strategy import ZeroStrategy
from lightscale.testing import RankFailed, run_distributed


class _SaveAt(pl.Callback):
    """``trainer.save_checkpoint(paths[step])`` after the given steps; this rank's losses, also written to
    ``losses.<rank>.json`` before each save (the record of a run that dies)."""

    def __init__(self, paths: dict[int, str]) -> None:
        self.paths = paths
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step in self.paths:
            path = Path(self.paths[trainer.global_step])
            (path.parent / f"losses.{trainer.global_rank}.json").write_text(json.dumps(self.losses))
            trainer.save_checkpoint(path)


def _die_in_second_write(function: Any) -> Any:
    """Rank 1 exits where it starts writing its shards of the second save (in the async side thread)."""
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if dist.get_rank() == 1 and calls["n"] == 2:
            os._exit(1)
        return function(*args, **kwargs)

    return wrapped


def _train(cache_dir: str, paths: dict[int, str], *, asynchronous: bool, resume: str | None = None, kill: bool = False):
    saver = _SaveAt(paths)
    patch = mock.patch.object(FileSystemWriter, "write_data", _die_in_second_write(FileSystemWriter.write_data))
    with patch if kill else mock.patch.dict({}):
        train_tiny_gpt(
            FSDP2Strategy(async_save=asynchronous),
            devices=2,
            batch_size=4,
            max_steps=5,
            cache_dir=cache_dir,
            extra_callbacks=[saver],
            resume_from=resume,
            default_root_dir=str(Path(next(iter(paths.values()))).parent),
        )
    return saver.losses


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and Adam state), read in one process."""
    entries = SafeFileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    load_safely(state, checkpoint, no_dist=True)
    return state


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    first, second = _tensors(a), _tensors(b)
    assert sorted(first) == sorted(second) and any(key.startswith("optimizer.state.") for key in first)
    for key, tensor in first.items():
        assert torch.equal(tensor, second[key]), key


def test_async_save_matches_sync_and_survives_a_kill_mid_write(corpus_cache: str, tmp_path: Path) -> None:
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync_dir.mkdir(), async_dir.mkdir()
    sync = {2: str(sync_dir / "step2.ckpt"), 4: str(sync_dir / "step4.ckpt")}
    reference = run_distributed(_train, corpus_cache, sync, asynchronous=False, world_size=2, timeout_s=300)

    last = str(async_dir / "last.ckpt")
    with pytest.raises(RankFailed):
        run_distributed(_train, corpus_cache, {2: last, 4: last}, asynchronous=True, kill=True, world_size=2)
    # The step-4 write died half-way beside the step-2 checkpoint, which is whole and is the synchronous one.
    assert sorted(p.name for p in async_dir.iterdir() if "ckpt" in p.name) == ["last.ckpt", "last.ckpt.tmp"]
    _assert_same_checkpoint(Path(last), Path(sync[2]))
    for rank in range(2):  # training with saves in flight took the same steps as with blocking saves
        assert json.loads((async_dir / f"losses.{rank}.json").read_text()) == reference[rank][:4]

    resumed = run_distributed(
        _train, corpus_cache, {3: last, 4: last}, asynchronous=True, resume=last, world_size=2, timeout_s=300
    )
    assert resumed == [losses[2:] for losses in reference]  # steps 3-5 from step 2's weights and Adam state
    # Step 4 staged into step 3's buffers, and in flight at fit's end: published before fit returned.
    _assert_same_checkpoint(Path(last), Path(sync[4]))
    assert sorted(p.name for p in async_dir.iterdir() if "ckpt" in p.name) == ["last.ckpt"]


def test_async_save_on_a_strategy_without_it_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"async_save=True is not supported by ZeroStrategy.*FSDP2Strategy"):
        ZeroStrategy(async_save=True)
