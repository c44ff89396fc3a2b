"""DeepSpeed's own checkpoint directories (``checkpoint_format="deepspeed"``): saved atomically, read without
unpickling code, and consolidated into one fp32 state dict.

The engine writes a directory per checkpoint (one model and one optimizer shard per rank). DeepSpeed reads
those back with ``torch.load(weights_only=False)``; lightscale loads them weights-only, allow-listing the
three plain data classes DeepSpeed stores (its stage enum, loss-scaler settings, fragment addresses).
The engine writes in place, so a save goes to ``CKPT.tmp`` and is swapped in (atomic_dir.py).

At an fsspec URL (``s3://...``; DeepSpeed writes and reads local paths only) each rank has the engine write into a
local scratch directory and uploads its own files under the checkpoint's prefix (or its staging prefix); rank 0 then
publishes it behind the completion marker, as for the portable layout (storage/urls.py). A load downloads, after
checking the marker, the files this rank reads (every shared file and its own partitions) to scratch, and the engine
reads them there through the same weights-only loader.

Example:
    >>> state = consolidate_zero_checkpoint("checkpoints/last.ckpt")  # {"tok_embeddings.weight": ..., ...}
    >>> GPT(config).load_state_dict(state)

    $ lightscale export checkpoints/last.ckpt gpt.pt
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightscale.patches.deepspeed import zero_to_fp32_loading_with
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.storage.safe_io import checkpoint_safe_globals, load_with_package_classes
from lightscale.storage.staged_copy import local_directory
from lightscale.storage.urls import Location, checkpoint_location

CHECKPOINT_TAG = "checkpoint"  # the engine's tag sub-directory inside every lightscale ZeRO checkpoint
# The files of one data-parallel rank: its partitions (optimizer state; ZeRO-3 model state) and NVMe swap copies.


def deepspeed_safe_globals() -> list[Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: str | os.PathLike, map_location: Any = None, *, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)`` that accepts what lightscale and DeepSpeed checkpoints contain."""

    def load() -> Any:
        with torch.serialization.safe_globals([*checkpoint_safe_globals(), *deepspeed_safe_globals()]):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)

    return load_with_package_classes(path, load)


def safe_checkpoint_engine(engine_config: Any) -> Any:
    """DeepSpeed's torch checkpoint engine with weights-only loading, for an engine with ``engine_config``."""
    # The sub-module path: DeepSpeed 0.16 does not re-export the class from its package.
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return safe_load(path, map_location=map_location)

    return SafeTorchCheckpointEngine(engine_config)


def model_states_file(checkpoint: Path) -> Path | None:
    """The first ``*model_states.pt`` of a local lightscale ZeRO checkpoint directory (it holds the client state and
    the recorded parameter shapes), or None when there is none: not DeepSpeed's directory."""
    files = sorted((checkpoint / CHECKPOINT_TAG).glob("*model_states.pt"))
    return files[0] if files else None


def saved_parameter_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Full shape of every trained parameter of a lightscale ZeRO checkpoint directory, from the ``param_shapes``
    DeepSpeed records beside the model states (empty when it recorded none: saved without an optimizer)."""
    states = model_states_file(checkpoint)
    if states is None:
        return {}
    groups = safe_load(states, map_location="cpu", mmap=True).get("param_shapes") or []
    return {name: tuple(shape) for group in groups for name, shape in group.items()}


def consolidate_zero_checkpoint(
    checkpoint: str | os.PathLike | Location, *, prefix: str = "model."
) -> dict[str, Tensor]:
    """The full fp32 weights of a ZeRO-1/2/3 checkpoint directory (local or an fsspec URL), for the single-device
    model.

    ``prefix`` is stripped from the keys (the GPT recipe's LightningModule holds its model as ``model``);
    keys without it are dropped. Pass ``prefix=""`` to keep the LightningModule's keys.
    """
    directory = complete_checkpoint(checkpoint_location(checkpoint))
    if not (directory / CHECKPOINT_TAG).is_dir():
        raise FileNotFoundError(f"{directory} is not a ZeRO checkpoint directory (no {CHECKPOINT_TAG}/ inside).")
    with local_directory(directory) as local, zero_to_fp32_loading_with(safe_load) as zero_to_fp32:
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(local), tag=CHECKPOINT_TAG)  # safe_load
    return {key[len(prefix) :]: value.contiguous() for key, value in state.items() if key.startswith(prefix)}
