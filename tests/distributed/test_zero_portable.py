"""ZeRO checkpoints in the portable layout: zero2 -> zero3 -> fsdp2 on 4 ranks -> zero3_offload (CPU Adam), one chain.

One uninterrupted zero2 run of 12 steps saves at step 3; each link resumes the previous link's checkpoint, trains 3
steps under another strategy and saves. Every resume must see the saved parameters and Adam moments bitwise (read
back from the engine, gathered) and continue with the uninterrupted run's losses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from checkpoint_matrix import torch_live_state, zero_live_state
from helpers import relative_difference, train_tiny_gpt

from lightscale.checkpoint import SafeCheckpointIO
from lightscale.checkpoint.deepspeed_dir import CHECKPOINT_TAG
from lightscale.checkpoint.portable import TRAINER_STATE
from lightscale.storage.safe_dcp import SafeFileSystemReader, load_safely
from lightscale.strategies import ZeroStrategy
from lightscale.strategies.deepspeed import load_portable
from lightscale.testing import run_distributed

TOLERANCE = 1e-6  # relative, per step: the same arithmetic resumed; strategies differ only in reduction order
STEPS, EVERY = 12, 3
GLOBAL_BATCH = 8


def gathered_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Full fp32 weights, moments and steps as the running strategy holds them (the matrix harness's gatherers)."""
    live = zero_live_state if hasattr(trainer.strategy, "engine") else torch_live_state
    return {key: value for key, value in live(trainer).items() if isinstance(value, torch.Tensor)}


class Probe(pl.Callback):
    """The gathered state right after the restore (``on_train_start``) and right before each save."""

    def __init__(self, save_every: int, path: str) -> None:
        self.save_every, self.path = save_every, path
        self.restored: dict[str, torch.Tensor] = {}
        self.saved: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.global_step:
            self.restored = gathered_state(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.save_every:
            self.saved = gathered_state(trainer)
            trainer.save_checkpoint(self.path)


def _link(strategy: Any, cache_dir: str, save_at: int, save_to: str, resume_from: str | None, stop: bool) -> dict:
    """Train (resuming from ``resume_from``), save ``save_to`` at step ``save_at``; losses and gathered states."""
    probe = Probe(save_at, save_to)
    stopper = [_StopAt(save_at)] if stop else []
    losses = train_tiny_gpt(
        strategy,
        devices=dist.get_world_size(),
        batch_size=GLOBAL_BATCH // dist.get_world_size(),
        cache_dir=cache_dir,
        max_steps=STEPS,
        resume_from=resume_from,
        extra_callbacks=[probe, *stopper],
    )
    return {"losses": losses, "restored": probe.restored, "saved": probe.saved}


class _StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.global_step >= self.step


def read_back(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, full size, read offline in this process (weights-only)."""
    entries = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {key: meta for key, meta in entries.items() if hasattr(meta, "chunks")}
    full = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in tensors.items()}
    load_safely(full, path, no_dist=True)
    return full


def assert_bitwise(gathered: dict[str, torch.Tensor], file: dict[str, torch.Tensor]) -> None:
    """Every parameter, moment and step a strategy holds equals the file's, bit for bit."""
    assert len(gathered) >= 4 * 19, len(gathered)  # the tiny GPT's 19 parameters: weight, 2 moments, step each
    assert gathered.keys() <= file.keys(), sorted(gathered.keys() - file.keys())[:3]
    for key, tensor in gathered.items():
        assert tensor.dtype == file[key].dtype and torch.equal(tensor, file[key]), key


CHAIN = [("zero3", 2), ("fsdp2", 4), ("zero3_offload", 2)]


def test_zero_checkpoints_cross_strategies_and_world_sizes(corpus_cache: str, tmp_path: Path, monkeypatch) -> None:
    # Loads read a few parameters at a time: small batches here (the embeddings alone, then groups of small ones).
    monkeypatch.setattr(load_portable, "LOAD_BATCH_NUMEL", 4096)
    first = tmp_path / "zero2.ckpt"
    reference = run_distributed(
        _link, "zero2", corpus_cache, EVERY, str(first), None, False, world_size=2, timeout_s=300
    )[0]
    assert len(reference["losses"]) == STEPS
    file = read_back(first)
    assert_bitwise(reference["saved"], file)  # what the engine held is what was written
    trainer_state = SafeCheckpointIO().load_checkpoint(first / TRAINER_STATE)
    assert trainer_state["lightscale"].items() >= {"format": 1, "strategy": "ZeroStrategy", "world_size": 2}.items()
    assert trainer_state["global_step"] == EVERY and "state_dict" not in trainer_state
    previous, step = first, EVERY
    for strategy, ranks in CHAIN:
        saved_to = tmp_path / f"{strategy}.ckpt"
        out = run_distributed(
            _link,
            strategy,
            corpus_cache,
            step + EVERY,
            str(saved_to),
            str(previous),
            True,
            world_size=ranks,
            timeout_s=300,
        )[0]
        assert_bitwise(out["restored"], read_back(previous))  # the resumed engine holds the file's values
        assert relative_difference(out["losses"], reference["losses"][step : step + EVERY]) <= TOLERANCE, strategy
        assert_bitwise(out["saved"], read_back(saved_to))
        if strategy.startswith("zero"):
            entry = SafeCheckpointIO().load_checkpoint(saved_to / TRAINER_STATE)["lightscale"]
            assert entry.items() >= {"format": 1, "strategy": "ZeroStrategy", "world_size": ranks}.items()
        previous, step = saved_to, step + EVERY


def test_a_deepspeed_directory_resumes_and_is_saved_again_in_the_layout(corpus_cache: str, tmp_path: Path) -> None:
    native, portable = tmp_path / "native.ckpt", tmp_path / "portable.ckpt"
    saver = ZeroStrategy(stage=2, checkpoint_format="deepspeed")
    reference = run_distributed(_link, saver, corpus_cache, EVERY, str(native), None, False, world_size=2)[0]
    assert (native / CHECKPOINT_TAG).is_dir()  # DeepSpeed's own directory
    out = run_distributed(_link, "zero2", corpus_cache, 2 * EVERY, str(portable), str(native), True, world_size=2)[0]
    assert_bitwise(out["restored"], reference["saved"])  # imported exactly
    assert relative_difference(out["losses"], reference["losses"][EVERY : 2 * EVERY]) <= TOLERANCE
    assert_bitwise(out["saved"], read_back(portable))  # and written in the portable layout
