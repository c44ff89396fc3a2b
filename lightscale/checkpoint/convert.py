"""Offline conversion and export (the one path of ``lightscale convert`` and ``lightscale export``): any lightscale
checkpoint in, one model file or directory out.

Sources (detected from what ``IN`` is):

==============  ==================================================  ==========================================
source          what it is                                          read with
==============  ==================================================  ==========================================
``dcp``         a portable DCP checkpoint directory (``.metadata``)  the restricted unpickler (safe_dcp.py)
``deepspeed``   a DeepSpeed engine directory (``checkpoint/``)       zero_to_fp32, every load weights-only
``lightning``   a single-file Lightning ``.ckpt`` (``state_dict``)   ``torch.load(weights_only=True)``
``torch``       a ``torch.save`` state dict of the plain model       ``torch.load(weights_only=True)``
``safetensors``  a ``.safetensors`` file of the plain model          safetensors (no pickle at all)
==============  ==================================================  ==========================================

Targets: ``safetensors`` (one file; tensors that share storage, such as tied embeddings, are stored once per
name, so ``load_file`` then a strict ``load_state_dict`` works), ``torch`` (a weights-only ``torch.save`` file) and
``dcp`` (the portable layout's ``model`` part plus a ``trainer_state.pt`` that names no loop state). Every write
is atomic: a ``.partial`` file (``safe_io.atomic_path``) or a ``.tmp`` directory beside the target, then a rename.

Keys: Lightning checkpoints hold the LightningModule's keys (``model.transformer.h.0...``); plain files hold the
single-device model's (``transformer.h.0...``). ``prefix`` (the LightningModule attribute holding the model) is
stripped when reading Lightning checkpoints (keys without it are dropped) and added back for ``dcp`` output.

Example:
    >>> convert("runs/last.ckpt", "gpt.safetensors")  # then GPT(config).load_state_dict(load_file(...))
    'safetensors'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning
from safetensors import SafetensorError
from safetensors.torch import load, load_file, save, save_file
from torch import Tensor

from lightscale.checkpoint.deepspeed_dir import CHECKPOINT_TAG, consolidate_zero_checkpoint
from lightscale.checkpoint.portable import check_checkpoint_dir, full_model_state_dict, write_checkpoint
from lightscale.errors import ConfigurationError
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.storage.safe_io import atomic_path, load_weights_only, save_atomically
from lightscale.storage.urls import Location, RemotePath, checkpoint_location

TARGETS = ("safetensors", "torch", "dcp")
SOURCES = ("dcp", "deepspeed", "lightning", "torch", "safetensors")
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
CONVERTED_BY = "lightscale convert"  # the "strategy" recorded in a converted checkpoint's trainer state


def infer_target(output: str | os.PathLike, *, default: str = "dcp") -> str:
    """``.safetensors`` -> safetensors, ``.pt``/``.pth``/``.bin`` -> torch, anything else -> ``default``."""
    suffix = Path(output).suffix
    if suffix == ".safetensors":
        return "safetensors"
    return "torch" if suffix in TORCH_SUFFIXES else default


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ConfigurationError(f"--to {target!r} is not a conversion target; valid: {list(TARGETS)}.")


def detect_source(path: Location) -> str:
    """Which of :data:`SOURCES` ``path`` is (files are told apart by their content when loaded)."""
    if path.is_dir():
        if (path / CHECKPOINT_TAG).is_dir():
            return "deepspeed"
        if (path / ".metadata").is_file():
            return "dcp"
        raise ConfigurationError(
            f"{path} is a directory but neither a DCP checkpoint (no .metadata) nor a DeepSpeed engine directory "
            f"(no {CHECKPOINT_TAG}/); convert reads {list(SOURCES)}."
        )
    if not path.is_file():
        raise ConfigurationError(f"{path} does not exist; convert reads a checkpoint directory or file.")
    return "safetensors" if path.suffix == ".safetensors" else "torch"


def read_model_state(
    checkpoint: str | os.PathLike, *, prefix: str = "model.", source: str = "auto", averaged: bool = False
) -> dict[str, Tensor]:
    """The full model tensors of any checkpoint, keyed as the single-device model's ``state_dict``; ``averaged``:
    a weight-averaging callback's average instead (kept in the portable layout only).

    Runs in one process, no process group; never runs code from the files (a payload is refused with
    :class:`~lightscale.storage.safe_dcp.UnsafeCheckpointError`).
    """
    path = complete_checkpoint(checkpoint_location(checkpoint))  # a local path or an fsspec URL
    source = detect_source(path) if source == "auto" else source
    if averaged and source != "dcp":
        raise ConfigurationError(
            f"--averaged reads the average a WeightAveraging callback saved in the portable layout; {path} is a "
            f"{source} checkpoint, which keeps none."
        )
    if source == "dcp":
        if not (path / ".metadata").is_file():
            check_checkpoint_dir(path)  # raises, naming what a DCP checkpoint directory holds
        return full_model_state_dict(path, prefix=prefix, part="averaged" if averaged else "model")
    if source == "deepspeed":
        return _non_empty(consolidate_zero_checkpoint(path, prefix=prefix), path, prefix)
    if source == "safetensors":
        return _read_safetensors(path)
    return _read_torch_file(path, prefix=prefix)


def _non_empty(state: dict[str, Tensor], path: Location, prefix: str) -> dict[str, Tensor]:
    if not state:
        raise ConfigurationError(f"No model key of {path} starts with prefix {prefix!r}; pass --prefix '' to keep all.")
    return state


def _read_safetensors(path: Location) -> dict[str, Tensor]:

    try:
        return load(path.read_bytes().getvalue()) if isinstance(path, RemotePath) else load_file(path)
    except SafetensorError as error:
        raise ConfigurationError(f"{path} is not a readable .safetensors file: {error}") from None


def _read_torch_file(path: Location, *, prefix: str) -> dict[str, Tensor]:
    """A Lightning ``.ckpt`` (its ``state_dict``, ``prefix`` stripped) or a plain state dict, weights-only."""
    loaded = load_weights_only(path)
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):  # a Lightning checkpoint
        state = loaded["state_dict"]
        model = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
        if not model:
            raise ConfigurationError(f"No state_dict key of {path} starts with {prefix!r}; keys: {sorted(state)[:3]}.")
        return model
    if not isinstance(loaded, dict) or not all(isinstance(value, Tensor) for value in loaded.values()):
        raise ConfigurationError(
            f"{path} holds a {type(loaded).__name__} that is neither a Lightning checkpoint (no 'state_dict') nor a "
            "state dict of tensors."
        )
    return loaded


def write_model_state(
    state: dict[str, Tensor], output: str | os.PathLike, target: str, *, prefix: str = "model."
) -> None:
    """Write the single-device ``state`` as ``target`` (one of :data:`TARGETS`) at ``output``, atomically."""
    check_target(target)
    output = checkpoint_location(output)  # a local path or an fsspec URL
    if isinstance(output, Path):
        output.parent.mkdir(parents=True, exist_ok=True)
    if target == "safetensors":
        save_safetensors(state, output)
    elif target == "torch":
        save_atomically(state, output)
    else:
        save_model_dcp(state, output, prefix=prefix)


def save_safetensors(state: dict[str, Tensor], output: Location) -> None:
    """One ``.safetensors`` file that ``load_file`` + ``model.load_state_dict`` (strict) reads back.

    safetensors refuses tensors that share memory; tied weights (the GPT's embedding and head) are therefore
    stored once per name (a copy each), which is what a strict ``load_state_dict`` of the tied model expects.
    """

    not_tensors = sorted(key for key, value in state.items() if not isinstance(value, Tensor))
    if not_tensors:
        raise ConfigurationError(f"safetensors stores tensors only; these entries are not: {not_tensors[:5]}.")
    if isinstance(output, RemotePath):  # one object, written whole
        output.write_bytes(save(_unshared(state), metadata={"format": "pt"}))
        return
    with atomic_path(output) as partial:
        save_file(_unshared(state), str(partial), metadata={"format": "pt"})


def _unshared(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Contiguous tensors, none sharing storage with another (the later names of a shared one get copies)."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen and tensor.numel() else tensor
        seen.add(pointer)
    return out


def save_model_dcp(state: dict[str, Tensor], output: Location, *, prefix: str = "model.") -> None:
    """The portable layout's ``model`` part (LightningModule keys: ``prefix`` added) and a trainer state that
    records where it came from; written by the one writer of the layout, in one process."""

    model = {prefix + name: tensor.detach().contiguous() for name, tensor in state.items()}
    trainer_state: dict[str, Any] = {
        "pytorch-lightning_version": lightning.__version__,
        "lightscale": {"format": 1, "strategy": CONVERTED_BY, "world_size": 1},
    }
    write_checkpoint(output, {"model": model}, trainer_state, lambda data, path: save_atomically(data, path))


def convert(
    checkpoint: str | os.PathLike, output: str | os.PathLike, *, target: str | None = None, prefix: str = "model."
) -> str:
    """Read ``checkpoint`` (any of :data:`SOURCES`) and write its model as ``target`` (default: inferred from
    ``output``'s suffix, see :func:`infer_target`). Returns the target written."""
    target = target or infer_target(output)
    check_target(target)
    write_model_state(read_model_state(checkpoint, prefix=prefix), output, target, prefix=prefix)
    return target
