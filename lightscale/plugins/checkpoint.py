"""Checkpoint I/O that never unpickles arbitrary code.

Lightning's ``TorchCheckpointIO`` already writes atomically (temporary file, then rename); lightscale's
plugin adds the safe default for reading: ``torch.load(weights_only=True)``, with the few plain containers
Lightning stores in a checkpoint allow-listed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightscale.errors import ConfigurationError

_ALLOWED: list[Any] = []


def allow_in_checkpoints(*classes: type) -> None:
    """Let plain data classes (e.g. a model config saved in hyper-parameters) load with ``weights_only=True``."""
    _ALLOWED.extend(cls for cls in classes if cls not in _ALLOWED)


def checkpoint_safe_globals() -> list[Any]:
    """Classes a lightscale checkpoint may hold besides tensors and containers (all plain data)."""
    from lightning.fabric.utilities.data import AttributeDict

    return [AttributeDict, *_ALLOWED]


class SafeCheckpointIO(TorchCheckpointIO):
    """Atomic saves; loads with ``weights_only=True`` unless the caller explicitly trusts the file."""

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        trusted_code = weights_only is False  # only an explicit False opts out
        with torch.serialization.safe_globals(checkpoint_safe_globals()):
            return super().load_checkpoint(path, map_location=map_location, weights_only=not trusted_code)


def save_atomically(state: dict[str, Any], output: Path) -> None:
    """``torch.save`` to ``output.partial``, then rename: never a half-written file under the final name."""
    partial = output.with_name(output.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, output)


def export_single_file(checkpoint: str | os.PathLike, output: str | os.PathLike, *, prefix: str = "model.") -> int:
    """The model weights of a single-file Lightning checkpoint (bucketed_ddp, one device), loaded weights-only,
    with ``prefix`` stripped (keys without it dropped; ``prefix=""`` keeps all). Returns the count written."""
    state = SafeCheckpointIO().load_checkpoint(checkpoint).get("state_dict", {})
    model = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    if not model:
        raise ConfigurationError(
            f"No state_dict key of {checkpoint} starts with {prefix!r}; keys: {sorted(state)[:3]}."
        )
    save_atomically(model, Path(output))
    return len(model)
