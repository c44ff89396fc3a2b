"""Start training from the model part of a portable checkpoint (weights only: fresh optimizer, step 0).

``lightscale convert gpt.safetensors init.ckpt --to dcp`` (or any checkpoint in the portable layout) gives a
directory whose ``model`` entries :class:`InitWeights` loads into the already parallelized model at the start of
fit: DCP reshards the full tensors into this rank's shards (FSDP2's DTensors) or whole tensors (bucketed_ddp).
Resuming (``ckpt_path=``) would need the optimizer state too; this needs only the weights.

Strategies whose ``weights_settable_after_setup`` is False (the ZeRO family) are refused: DeepSpeed builds its fp32
master copies from the weights when the engine starts, before any callback runs, so loading the weights afterwards
would train from the old masters.

Example:
    >>> trainer = lightscale.Trainer(strategy="fsdp2", devices=4, callbacks=[InitWeights("init.ckpt")])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightscale.checkpoint.portable import load_model_part
from lightscale.errors import ConfigurationError
from lightscale.strategies.base import LightscaleStrategy


class InitWeights(pl.Callback):
    """Load the weights of a portable checkpoint (e.g. ``lightscale convert ... --to dcp``) when fit starts."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, LightscaleStrategy) and not strategy.weights_settable_after_setup:
            raise ConfigurationError(
                f"InitWeights({str(self.path)!r}) cannot run under {type(strategy).__name__}: DeepSpeed "
                "builds its fp32 master weights before callbacks run, so they would keep the old values. Use a "
                "strategy whose parameters are the trained values (fsdp2, hsdp, bucketed_ddp)."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is None:  # a resumed run (after a failure, ckpt_path="last") keeps its trained weights
            load_model_part(self.path, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {}
