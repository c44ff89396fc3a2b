"""Hugging Face out: the model of a checkpoint as a directory ``from_pretrained`` loads (``config.json`` and
``model.safetensors``, sharded above a size with the index file HF expects).

At save time every strategy records, in ``trainer_state.pt``, which submodules of the LightningModule are
``transformers`` models (``PreTrainedModel``, found by type without importing transformers) or models with a
dataclass ``config`` (the GPT recipe's): attribute, class name and config as JSON text (plain data, nothing to
unpickle). Export reads the full weights of that attribute from the portable layout (raw, or a weight-averaging
callback's average) and, for a transformers model, has transformers itself write the directory: the class is looked
up by name in ``transformers`` (nothing from the checkpoint is imported or run), built on the meta device, given the
weights and saved with ``save_pretrained``. Any other model gets its dataclass config as ``config.json`` and the
weights through ``huggingface_hub.save_torch_state_dict`` (HF's own sharded writer).

At an fsspec URL (``s3://bucket/hf``) the folder is written to a local scratch directory by the same writers, then
uploaded file by file with ``config.json`` last: ``from_pretrained`` starts from it, so a folder whose upload died
is never taken for a model (lightscale's completion marker means nothing to Hugging Face's readers). Exporting over
an earlier export removes its ``config.json`` first and its weight files that the new one does not write.

Example:
    >>> export_hf("runs/last.ckpt", "out/")  # then AutoModelForCausalLM.from_pretrained("out/")
    >>> export_hf("s3://bucket/run/last.ckpt", "s3://bucket/hf")  # download, then from_pretrained
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightscale.checkpoint.portable import TRAINER_STATE, check_checkpoint_dir, full_model_state_dict
from lightscale.errors import ConfigurationError, import_extra
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.storage.safe_io import SafeCheckpointIO
from lightscale.storage.staged_copy import scratch_directory, upload_directory
from lightscale.storage.urls import RemotePath, checkpoint_location

MODELS = "models"  # trainer_state["lightscale"][MODELS]: [{"attribute", "class", "library", "config"}]
DEFAULT_SHARD_SIZE = "5GB"  # transformers' default for save_pretrained
CONFIG = "config.json"  # what from_pretrained reads first: uploaded last
_WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")  # HF's names of the weight files


def describe_models(module: nn.Module) -> list[dict[str, str]]:
    """The exportable models inside ``module`` (outermost first): ``transformers`` models and modules whose
    ``config`` is a dataclass, each with its attribute path, class name and config as JSON text."""
    found: list[dict[str, str]] = []
    for name, sub in module.named_modules():
        if not name or any(name.startswith(entry["attribute"] + ".") for entry in found):
            continue
        cls = next(c for c in type(sub).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses the model
        if _is_transformers_model(sub):
            config = sub.config.to_json_string(use_diff=False)
            found.append({"attribute": name, "class": cls.__name__, "library": "transformers", "config": config})
        elif dataclasses.is_dataclass(getattr(sub, "config", None)) and not isinstance(sub.config, type):
            fields = {**dataclasses.asdict(sub.config), "architectures": [f"{cls.__module__}.{cls.__name__}"]}
            config = json.dumps(fields)
            found.append({"attribute": name, "class": cls.__name__, "library": cls.__module__, "config": config})
    return found


def _is_transformers_model(module: nn.Module) -> bool:
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers") for cls in type(module).__mro__
    )


def recorded_models(checkpoint: Path) -> list[dict[str, str]]:
    """What :func:`describe_models` recorded when ``checkpoint`` (a portable layout directory) was saved."""
    check_checkpoint_dir(checkpoint)
    state = SafeCheckpointIO().load_checkpoint(checkpoint / TRAINER_STATE)
    return list(state.get("lightscale", {}).get(MODELS, []))


def choose_model(models: list[dict[str, str]], attribute: str | None, checkpoint: Path) -> dict[str, str]:
    """The model named ``attribute`` (``--module``), else the only one recorded; a clear error otherwise."""
    names = [entry["attribute"] for entry in models]
    if attribute is not None:
        for entry in models:
            if entry["attribute"] == attribute:
                return entry
        raise ConfigurationError(
            f"--module {attribute!r} is not an exportable model of {checkpoint}; recorded: {names or 'none'}."
        )
    if len(models) == 1:
        return models[0]
    if not models:
        raise ConfigurationError(
            f"{checkpoint} records no exportable model: --hf needs a LightningModule holding a transformers "
            "PreTrainedModel (or a model with a dataclass `config`, like the GPT recipe's), saved by this lightscale "
            "version. Export the raw weights without --hf."
        )
    raise ConfigurationError(f"{checkpoint} holds several exportable models {names}; name one with --module.")


def export_hf(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    module: str | None = None,
    averaged: bool = False,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
) -> dict[str, str]:
    """Write the model of ``checkpoint`` (raw weights, or the average with ``averaged``) to directory ``output``;
    returns the record of the model written. One process, no process group; nothing in the checkpoint runs."""
    path = complete_checkpoint(checkpoint_location(checkpoint))  # a local path or an fsspec URL
    entry = choose_model(recorded_models(path), module, path)
    part = "averaged" if averaged else "model"
    state = full_model_state_dict(path, prefix=entry["attribute"] + ".", part=part)
    output = checkpoint_location(output)  # a local path or an fsspec URL
    if isinstance(output, RemotePath):
        with scratch_directory() as local:
            _write_folder(entry, state, local, max_shard_size)
            _upload_folder(local, output)
        return entry
    output.mkdir(parents=True, exist_ok=True)
    _write_folder(entry, state, output, max_shard_size)
    return entry


def _write_folder(
    entry: dict[str, str], state: dict[str, torch.Tensor], output: Path, max_shard_size: str | int
) -> None:
    if entry["library"] == "transformers":
        _save_pretrained(entry, state, output, max_shard_size)
    else:
        _save_plain(entry, state, output, max_shard_size)


def _upload_folder(local: Path, output: RemotePath) -> None:
    """``local``'s files under ``output``, ``config.json`` last; an earlier export there stops being a model first
    (its config removed) and loses the weight files the new one does not write."""
    new = {path.name for path in local.iterdir()}
    if (output / CONFIG).exists():
        output.fs.rm((output / CONFIG).key)
    for name in output.names():
        if _WEIGHTS.fullmatch(name) and name not in new:
            output.fs.rm((output / name).key)
    upload_directory(local, output, last=(CONFIG,))


def _save_pretrained(
    entry: dict[str, str], state: dict[str, torch.Tensor], output: Path, max_shard_size: str | int
) -> None:
    transformers = import_extra("transformers", "hf", error=ConfigurationError)
    cls = getattr(transformers, entry["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ConfigurationError(
            f"{entry['class']!r} is not a model class of the installed transformers {transformers.__version__}."
        )
    config = cls.config_class.from_dict(json.loads(entry["config"]))
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(state, strict=True, assign=True)  # the full weights, no second copy
    model.tie_weights()
    _materialize_non_persistent(model)
    model.save_pretrained(output, max_shard_size=max_shard_size, safe_serialization=True)


def _materialize_non_persistent(model: nn.Module) -> None:
    """Buffers left out of the state dict (rotary frequencies) are recomputed by the model; none may stay on meta."""
    for sub in model.modules():
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer.is_meta:
                sub.register_buffer(name, torch.zeros(buffer.shape, dtype=buffer.dtype), persistent=False)


def _save_plain(entry: dict[str, str], state: dict[str, torch.Tensor], output: Path, max_shard_size: str | int) -> None:
    hub = import_extra("huggingface_hub", "hf", error=ConfigurationError)
    hub.save_torch_state_dict(state, output, max_shard_size=max_shard_size)
    (output / "config.json").write_text(json.dumps(json.loads(entry["config"]), indent=2) + "\n")
