"""``InitWeights``: a run starts from a converted checkpoint's weights (``lightscale convert ... --to dcp``),
resharded into FSDP2's shards, bitwise; ZeRO strategies are refused before any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import TINY, train_tiny_gpt
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lightscale.callbacks.init_weights import InitWeights
from lightscale.cli import main
from lightscale.errors import ConfigurationError
from lightscale.recipes.gpt import GPT
from lightscale.testing import run_distributed


class _FullWeightsAtStart(pl.Callback):
    """The gathered full weights when training starts (after InitWeights loaded them), on rank 0."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(pl_module, options=options)
        if dist.get_rank() == 0:
            self.weights = {key.removeprefix("model."): value.clone() for key, value in full.items()}


def _fit(cache_dir: str, init: str) -> dict[str, torch.Tensor]:
    probe = _FullWeightsAtStart()
    train_tiny_gpt(
        "fsdp2", devices=2, batch_size=4, max_steps=1, cache_dir=cache_dir, extra_callbacks=[InitWeights(init), probe]
    )
    return probe.weights


def test_fit_starts_from_converted_weights(corpus_cache: str, tmp_path: Path) -> None:
    torch.manual_seed(7)  # not the seed the run initializes with: the weights must come from the file
    source = GPT(TINY)
    torch.save(source.state_dict(), tmp_path / "gpt.pt")
    main(["convert", str(tmp_path / "gpt.pt"), str(tmp_path / "init.ckpt"), "--to", "dcp"])
    weights = run_distributed(_fit, corpus_cache, str(tmp_path / "init.ckpt"), world_size=2, timeout_s=300)[0]
    expected = source.state_dict()
    assert sorted(weights) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(weights[key], tensor), key


def test_init_weights_under_zero_is_refused(tmp_path: Path) -> None:
    import lightscale

    trainer = lightscale.Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=1, logger=False)
    with pytest.raises(ConfigurationError, match=r"InitWeights\(.*\) cannot run under ZeroStrategy"):
        InitWeights(tmp_path).setup(trainer, None, "fit")
