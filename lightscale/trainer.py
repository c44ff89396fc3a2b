"""``lightscale.Trainer``: Lightning's Trainer with lightscale's names registered and input checked up front."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch import Trainer as LightningTrainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightscale.callbacks.model_summary import with_global_summary
from lightscale.checkpoint.resume import check_resume, checkpoint_dir, resolve_last, resolve_resume
from lightscale.data.data_shard import forget_data_shard
from lightscale.errors import ConfigurationError
from lightscale.plugins.precision import (
    check_precision,
    check_strategy_precision,
    maybe_cpu_fp16_plugin,
    maybe_float8_plugin,
)
from lightscale.storage.urls import RemotePath
from lightscale.strategies.base import LightscaleStrategy
from lightscale.strategies.registry import check_strategy, patch_lightning, register_strategies


class Trainer(LightningTrainer):
    """A ``lightning.Trainer`` that knows lightscale's strategies without ``import lightscale`` side effects.

    Before any work starts it rejects unknown strategy names (naming the closest match), more devices than the
    machine has, and precision names without one meaning under every strategy.

    ``resume="auto"`` makes every ``fit`` continue from the newest complete checkpoint in the ModelCheckpoint's
    ``dirpath`` (none there: start fresh); an explicit ``fit(ckpt_path=...)`` wins; ``fit``, ``validate``, ``test``
    and ``predict`` with ``ckpt_path="last"`` also find the last checkpoint when ModelCheckpoint writes to an fsspec
    URL. See :mod:`lightscale.checkpoint.resume`.

    Example:
        >>> Trainer(strategy="bucketed_ddp", accelerator="cpu", devices=2, max_steps=100).fit(model, data)
    """

    def __init__(
        self,
        *args: Any,
        accelerator: str | Accelerator = "auto",
        strategy: str | Strategy = "auto",
        devices: list[int] | str | int = "auto",
        resume: str | None = None,
        precision: str | int | None = None,
        **kwargs: Any,
    ) -> None:
        # ``precision`` is named here so the CLI accepts lightscale's names Lightning's type does not list (float8);
        # ``accelerator``, ``strategy`` and ``devices`` with Lightning's types, which LightningCLI reads from this
        # signature: read from **kwargs with a default, jsonargparse took them as untyped, so
        # ``--trainer.strategy.init_args.X V`` reached Lightning as ``NestedArg(...)``.
        kwargs |= {"accelerator": accelerator, "strategy": strategy, "devices": devices, "precision": precision}
        patch_lightning()  # before Lightning parses its arguments (lightscale/strategies/registry.py)
        check_resume(resume)
        ignore_lightning_pytree_deprecation()
        register_strategies()
        check_strategy(strategy)
        check_devices(accelerator, devices)
        check_precision(precision)
        float8 = maybe_float8_plugin(precision, _as_list(kwargs.get("plugins")), accelerator)
        precision = float8.name if float8 is not None else precision
        emulate = float8 is not None and float8.float8.emulate
        check_strategy_precision(strategy, precision, accelerator, emulate=emulate)
        if float8 is not None and kwargs.get("precision") is not None:  # Lightning knows no float8 name: the plugin
            kwargs["precision"] = None
            kwargs["plugins"] = [*_as_list(kwargs.get("plugins")), float8]
        fp16_on_cpu = maybe_cpu_fp16_plugin(kwargs.get("precision"), accelerator)
        if fp16_on_cpu is not None:
            kwargs["precision"] = None
            kwargs["plugins"] = [*_as_list(kwargs.get("plugins")), fp16_on_cpu]
        summary = kwargs.get("enable_model_summary") is not False and not kwargs.get("barebones")
        kwargs["callbacks"] = with_global_summary(_as_list(kwargs.get("callbacks")), enabled=summary)
        kwargs["enable_model_summary"] = False  # decided above; Lightning would only say it skips its own
        super().__init__(*args, **kwargs)
        if not isinstance(self.strategy, LightscaleStrategy):  # a lightscale run earlier in this process published one
            forget_data_shard()
        self.resume = resume
        self._resume_dir: Path | RemotePath | None = None
        if resume == "auto":  # a run that could never find its checkpoints fails here, before any work
            has_logger = bool(self.loggers)
            self._resume_dir = checkpoint_dir(
                self.checkpoint_callbacks, has_logger=has_logger, default_root_dir=self.default_root_dir
            )

    @override
    def fit(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        ckpt_path: Any = None,
        weights_only: bool | None = None,
    ) -> None:
        ckpt_path = resolve_last(ckpt_path, self.checkpoint_callbacks)  # "last" in a bucket (Lightning cannot list it)
        ckpt_path = resolve_resume(self.resume, ckpt_path, self._resume_dir)
        super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)

    # validate/test/predict answer "last" in a bucket as fit does; signatures are Lightning's (LightningCLI reads them)
    @override
    def validate(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
        weights_only: bool | None = None,
    ) -> list[Mapping[str, float]]:
        ckpt_path = resolve_last(ckpt_path, self.checkpoint_callbacks)
        return super().validate(model, dataloaders, ckpt_path, verbose, datamodule, weights_only)

    @override
    def test(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
        weights_only: bool | None = None,
    ) -> list[Mapping[str, float]]:
        ckpt_path = resolve_last(ckpt_path, self.checkpoint_callbacks)
        return super().test(model, dataloaders, ckpt_path, verbose, datamodule, weights_only)

    @override
    def predict(
        self,
        model: LightningModule | None = None,
        dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> list[Any] | list[list[Any]] | None:
        ckpt_path = resolve_last(ckpt_path, self.checkpoint_callbacks)
        return super().predict(model, dataloaders, datamodule, return_predictions, ckpt_path, weights_only)


# torch >= 2.10 deprecates constructing ``LeafSpec``; Lightning's utilities/_pytree.py still does for each dataloader
# it combines, so every run printed it once per rank with nothing the user could change. Matched by message and by
# Lightning's module: the same deprecation raised by anyone else's code still shows.
_LIGHTNING_PYTREE = (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree")


def ignore_lightning_pytree_deprecation() -> None:
    message, module = _LIGHTNING_PYTREE
    warnings.filterwarnings("ignore", message, FutureWarning, module)


def device_count(devices: Any) -> int | None:
    """``devices`` as a count of processes per node: an int, or the digits the CLI gives (``--trainer.devices 4`` is
    the string "4" under Lightning's type); None for "auto", -1 and lists (Lightning resolves those)."""
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        return None
    return devices


def check_devices(accelerator: Any, devices: Any) -> None:
    """Reject more GPUs than this machine has, and warn about more CPU processes than cores, before Lightning starts
    processes. CPU ranks share cores (gloo, one thread each): the tiny GPT trained 30 steps at 4 ranks on 2 cores
    in each of 3 runs on a loaded machine, as Lightning and torchrun run it, so that is slower, not wrong."""
    devices = device_count(devices)
    if devices is None:
        return  # "auto", -1 and lists are resolved (and checked) by Lightning
    if _launched_externally():
        return  # torchrun, a cluster or a test harness decided how many processes run here
    wants_gpu = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if wants_gpu and devices > torch.cuda.device_count():
        available = torch.cuda.device_count()
        raise ConfigurationError(
            f"devices={devices} but this machine has {available} CUDA devices; valid values are 1..{available}."
        )
    cores = os.cpu_count() or 1
    if not wants_gpu and devices > cores:
        warnings.warn(
            f"devices={devices} starts {devices} CPU ranks on this machine's {cores} CPU cores: they share the cores, "
            "so steps are slower than on as many cores (the results are the same).",
            UserWarning,
            stacklevel=3,
        )


def _launched_externally() -> bool:
    # LOCAL_RANK is what Lightning itself checks; WORLD_SIZE is removed by its teardown after a first fit().
    return dist.is_initialized() or "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
