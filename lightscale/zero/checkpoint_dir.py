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
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightscale.errors import ConfigurationError
from lightscale.patches.deepspeed import skip_bit16_refresh, zero_to_fp32_loading_with
from lightscale.runtime.barrier import barrier
from lightscale.storage.atomic_dir import agreed_staging, complete_checkpoint, publish
from lightscale.storage.safe_io import checkpoint_safe_globals, load_with_package_classes
from lightscale.storage.shape_check import check_shapes
from lightscale.storage.staged_copy import local_directory, scratch_directory, upload_directory
from lightscale.storage.urls import Location, RemotePath, checkpoint_location
from lightscale.zero.partition import whole_shape

CHECKPOINT_TAG = "checkpoint"  # the engine's tag sub-directory inside every lightscale ZeRO checkpoint
# The files of one data-parallel rank: its partitions (optimizer state; ZeRO-3 model state) and NVMe swap copies.
_RANK_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_|(?:^|/)offloaded_tensors/rank(\d+)/")


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


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_engine_directory(engine: Any, target: Location, client_state: dict[str, Any]) -> None:
    """Collectively save ``engine`` as DeepSpeed's directory ``target``: written beside it, then swapped in (a URL:
    each rank's files uploaded from local scratch, then the completion marker)."""
    staging = agreed_staging(target)  # rank 0 cleared it before anyone writes
    if isinstance(staging, RemotePath):
        with scratch_directory() as local:
            engine.save_checkpoint(str(local), client_state=client_state, tag=CHECKPOINT_TAG)
            upload_directory(local, staging)  # this rank's files only: DeepSpeed names them by rank
    else:
        engine.save_checkpoint(str(staging), client_state=client_state, tag=CHECKPOINT_TAG)
    barrier()
    if _is_rank_zero():
        publish(staging, target)
    barrier()


def load_engine_directory(engine: Any, path: Location, *, fitting: bool) -> dict[str, Any]:
    """Collectively load DeepSpeed's directory ``path`` (local, or a complete one at a URL) into ``engine``
    (optimizer state when ``fitting``); returns the client state saved with it (the rest of Lightning's
    checkpoint)."""
    optimizer = engine.optimizer
    if not fitting:  # ZeRO-3 evaluation's optimizer stand-in has no fp32 master to refresh; DeepSpeed refreshes anyway
        skip_bit16_refresh(optimizer)
    model = {name: tuple(whole_shape(p)) for name, p in engine.module.named_parameters()}
    # data-parallel rank = global rank: lightscale's ZeRO spans the whole world
    keep = read_by_rank(dist.get_rank() if dist.is_initialized() else 0, elastic=engine.zero_elastic_checkpoint())
    with local_directory(path, keep=keep) as local:
        check_shapes(saved_parameter_shapes(local), model, str(path))  # before DeepSpeed reads any shard
        _, client_state = engine.load_checkpoint(
            str(local), tag=CHECKPOINT_TAG, load_optimizer_states=fitting, load_lr_scheduler_states=False
        )
    if client_state is None:
        raise ConfigurationError(f"{path} is not a checkpoint directory saved by a ZeRO strategy.")
    return client_state


def read_by_rank(rank: int, *, elastic: bool) -> Callable[[str], bool]:
    """Which files of a checkpoint (relative names) data-parallel ``rank``'s engine reads: all but other ranks'
    partitions; all of them with DeepSpeed's elastic checkpoints (``zero_optimization.elastic_checkpoint``)."""

    def keep(name: str) -> bool:
        match = _RANK_FILE.search(name)
        return elastic or match is None or int(match.group(1) or match.group(2)) == rank

    return keep
