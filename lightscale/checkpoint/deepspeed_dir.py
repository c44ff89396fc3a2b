"""DeepSpeed ZeRO checkpoints, read without unpickling code, and consolidated into one fp32 state dict.

The engine writes a directory per checkpoint (one model and one optimizer shard per rank). DeepSpeed reads
those back with ``torch.load(weights_only=False)``; lightscale loads them weights-only, allow-listing the
three plain data classes DeepSpeed stores (its stage enum, loss-scaler settings, fragment addresses).

Example:
    >>> state = consolidate_zero_checkpoint("checkpoints/last.ckpt")  # {"tok_embeddings.weight": ..., ...}
    >>> GPT(config).load_state_dict(state)

    $ lightscale export-zero checkpoints/last.ckpt gpt.pt
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import Tensor

from lightscale.plugins.atomic_dir import complete_checkpoint
from lightscale.plugins.checkpoint import checkpoint_safe_globals, save_atomically

CHECKPOINT_TAG = "checkpoint"  # the engine's tag sub-directory inside every lightscale ZeRO checkpoint


def deepspeed_safe_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: str | os.PathLike, map_location: Any = None, *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` that accepts what lightscale and DeepSpeed checkpoints contain."""
    with torch.serialization.safe_globals([*checkpoint_safe_globals(), *deepspeed_safe_globals()]):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def safe_checkpoint_engine(engine_config: Any) -> Any:
    """DeepSpeed's torch checkpoint engine with weights-only loading, for an engine with ``engine_config``."""
    # The sub-module path: DeepSpeed 0.16 does not re-export the class from its package.
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_load(path, map_location=map_location)

    return SafeTorchCheckpointEngine(engine_config)


def saved_parameter_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Full shape of every trained parameter of a lightscale ZeRO checkpoint directory, from the ``param_shapes``
    DeepSpeed records beside the model states (empty when it recorded none: saved without an optimizer)."""
    files = sorted((checkpoint / CHECKPOINT_TAG).glob("*model_states.pt"))
    if not files:
        return {}
    groups = safe_load(files[0], map_location="cpu", mmap=True).get("param_shapes") or []
    return {name: tuple(shape) for group in groups for name, shape in group.items()}


class _WeightsOnlyTorch:
    """Stands in for ``torch`` inside DeepSpeed's zero_to_fp32, so every load there is weights-only."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(path: Any, map_location: Any = None, mmap: bool = False, **_: Any) -> Any:
        return safe_load(path, map_location=map_location, mmap=mmap)


def consolidate_zero_checkpoint(checkpoint: str | os.PathLike, *, prefix: str = "model.") -> dict[str, Tensor]:
    """The full fp32 weights of a ZeRO-1/2/3 checkpoint directory, for the single-device model.

    ``prefix`` is stripped from the keys (the GPT recipe's LightningModule holds its model as ``model``);
    keys without it are dropped. Pass ``prefix=""`` to keep the LightningModule's keys.
    """
    from deepspeed.utils import zero_to_fp32

    directory = complete_checkpoint(Path(checkpoint))
    if not (directory / CHECKPOINT_TAG).is_dir():
        raise FileNotFoundError(f"{directory} is not a ZeRO checkpoint directory (no {CHECKPOINT_TAG}/ inside).")
    with mock.patch.object(zero_to_fp32, "torch", _WeightsOnlyTorch()):
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=CHECKPOINT_TAG)
    return {key[len(prefix) :]: value.contiguous() for key, value in state.items() if key.startswith(prefix)}


def export_zero_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, prefix: str = "model.") -> int:
    """Write :func:`consolidate_zero_checkpoint` to ``output`` (``torch.save``, weights-only loadable) atomically.

    Returns the number of tensors written.
    """
    state = consolidate_zero_checkpoint(checkpoint, prefix=prefix)
    if not state:
        raise ValueError(f"No keys start with prefix {prefix!r} in {checkpoint}; pass prefix='' to keep them all.")
    save_atomically(state, Path(output))  # never a half-written export under the final name
    return len(state)
