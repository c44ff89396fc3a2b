"""MemoryProfiler on a GPU: exact bytes of parameters, gradients and optimizer state, an allocator snapshot of the
chosen step (pytorch.org/memory_viz) that holds those parameters, and the timeline figure (skipped without CUDA)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from helpers import SGD_LR, TINY, train_tiny_gpt

from lightscale.callbacks import MemoryProfiler
from lightscale.recipes.gpt import GPT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_exact_bytes_and_a_snapshot_of_the_chosen_step(tmp_path: Path, corpus_cache: str) -> None:
    out = tmp_path / "memory"
    profiler = MemoryProfiler(every_n_steps=1, snapshot_steps=[1], out_dir=str(out))
    train_tiny_gpt(
        "auto",
        devices=1,
        batch_size=4,
        max_steps=3,
        cache_dir=corpus_cache,
        sgd_lr=SGD_LR,
        accelerator="gpu",
        extra_callbacks=[profiler],
    )
    # fp32, the tied embedding once (parameters() yields a shared parameter once); plain SGD keeps no state.
    param_bytes = sum(p.numel() * 4 for p in GPT(TINY).parameters())  # 135,808 B
    assert [r["step"] for r in profiler.records] == [1, 2, 3]
    for record in profiler.records:
        assert (record["parameters"], record["gradients"], record["optimizer"]) == (param_bytes, param_bytes, 0)
        assert record["peak"] >= 2 * param_bytes  # parameters and gradients were both live on the device
    snapshot = pickle.loads((out / "snapshot_step1_rank0.pickle").read_bytes())
    active = sum(
        block["size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    assert active >= param_bytes, (active, param_bytes)  # the parameters are in the allocator's state
    assert any(snapshot["device_traces"]), "no allocation was recorded during the chosen step"
    assert (out / "memory.png").stat().st_size > 0
