"""The one hook into Lightning's checkpoint loading: a lightscale checkpoint *directory* loads where Lightning
expects a file, in one plain process (``import lightscale`` installs it, through ``lightscale.patch_lightning()``:
lightscale/strategies/registry.py; no process group needed).

Lightning reads every checkpoint file through one function, ``lightning.fabric.utilities.cloud_io._load``, bound by
name in two modules: ``lightning.pytorch.core.saving`` (``Model.load_from_checkpoint``) and
``lightning.fabric.plugins.io.torch_io`` (``TorchCheckpointIO.load_checkpoint``: every Trainer's
``fit/validate/test/predict(ckpt_path=...)`` under Lightning's own strategies). Both names are rebound to a wrapper
that hands a local lightscale directory (the portable layout, DiLoCo's, DeepSpeed's own) to
lightscale/checkpoint/lightning_format.py, which returns the dictionary ``torch.load`` gives for a single-file
checkpoint, and passes anything else to Lightning's function unchanged (single files then also accept the classes
lightscale allow-lists for weights-only loading). ``load_from_checkpoint`` reads no optimizer state; the Trainer's
path does (Lightning restores it when fitting).

``Strategy.load_optimizer_state_dict`` (Lightning's base, which its single-device and DDP strategies use) is wrapped
to compare the run's optimizers with the ones the checkpoint recorded before torch loads the state: torch checks only
group sizes, so another optimizer class or order would load silently and fail later (or not at all). Checkpoints
that did not come from a lightscale directory pass through untouched.

Why a hook rather than a documented extension point: Lightning has none for "this path is a directory in another
format" outside its own strategies' ``load_checkpoint``, and the user calls Lightning's classmethod and Trainer with
Lightning's strategies, which lightscale does not own. Tested against the installed Lightning
(tests/unit/test_private_apis.py names the three attributes; tests/distributed/test_checkpoint_out.py loads through
them).

Example:
    >>> import lightscale  # installs the hook
    >>> model = MyModel.load_from_checkpoint("checkpoints/last.ckpt")  # a directory written by fsdp2
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies.strategy import Strategy

from lightscale.checkpoint.lightning_format import check_optimizers, is_lightscale_directory, lightning_checkpoint
from lightscale.patches.lightning import route_checkpoint_loading
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.storage.safe_io import checkpoint_safe_globals
from lightscale.storage.urls import Location, checkpoint_location


def _local_directory(path_or_url: Any) -> Location | None:
    """The lightscale checkpoint directory ``path_or_url`` names, local or an fsspec URL (or its previous copy after
    a crash), else None."""
    if not isinstance(path_or_url, str | Path) or str(path_or_url).startswith(("http://", "https://")):
        return None
    path = complete_checkpoint(checkpoint_location(path_or_url))
    return path if is_lightscale_directory(path) else None


def _loader(original: Callable[..., Any], *, optimizer: bool) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        directory = _local_directory(path_or_url)
        if directory is not None:
            return lightning_checkpoint(
                directory, optimizer=optimizer, map_location=map_location, weights_only=weights_only
            )
        if weights_only is False:
            return original(path_or_url, map_location=map_location, weights_only=weights_only)
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return original(path_or_url, map_location=map_location, weights_only=weights_only)

    return load


def _check(strategy: Strategy, checkpoint: Any) -> None:
    if strategy.lightning_module is not None:
        check_optimizers(checkpoint, strategy.lightning_module, strategy.optimizers)


def install_lightning_loading() -> None:
    """Install the hooks (idempotent; lightscale.patch_lightning() calls it). The rebinding: patches/lightning.py."""
    route_checkpoint_loading(lambda original, optimizer: _loader(original, optimizer=optimizer), _check)
