"""``lightscale consolidate CKPT OUT.ckpt [--with-optimizer]``: any lightscale checkpoint as one ordinary Lightning
checkpoint file, which plain Lightning loads without lightscale installed.

The output is what Lightning's own single-device strategy writes: ``state_dict`` under the LightningModule's keys,
``hyper_parameters``, loops, callbacks and LR schedulers, and with ``--with-optimizer`` each optimizer's
``state_dict()`` (torch's format: ``fit(ckpt_path=OUT)`` resumes); without it ``load_from_checkpoint``,
``validate``/``test``/``predict(ckpt_path=OUT)`` work and the file holds no optimizer state. Read by
lightscale/checkpoint/lightning_format.py (nothing in the input runs code), written atomically. Peak memory: the full
weights plus the piece of a tensor being read, and the optimizer state only with ``--with-optimizer``.

Either argument may be an fsspec URL (``s3://bucket/run/last.ckpt``; lightscale/storage/urls.py).

Example:
    $ lightscale consolidate checkpoints/last.ckpt model.ckpt
    >>> MyModel.load_from_checkpoint("model.ckpt")  # in a process without lightscale
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lightscale.checkpoint.averaged import from_lightning_convention, without_lightning_entries
from lightscale.checkpoint.lightning_format import is_lightscale_directory, lightning_checkpoint
from lightscale.errors import ConfigurationError
from lightscale.storage.atomic_dir import complete_checkpoint
from lightscale.storage.safe_io import load_weights_only, save_atomically
from lightscale.storage.urls import Location, checkpoint_location

WITHOUT_OPTIMIZER = "consolidated without --with-optimizer"


def consolidate(
    checkpoint: str | os.PathLike, output: str | os.PathLike, *, with_optimizer: bool = False, averaged: bool = True
) -> dict:
    """Write ``checkpoint`` (a lightscale directory or a single Lightning file) as the Lightning file ``output``;
    returns what was written. ``averaged=False`` (``--raw``) leaves a WeightAveraging average out of either: the
    raw weights as ``state_dict``."""
    path = complete_checkpoint(checkpoint_location(checkpoint))  # a local path or an fsspec URL
    if is_lightscale_directory(path):
        result = lightning_checkpoint(path, optimizer=with_optimizer, averaged=averaged)
    elif path.is_file():
        result = _read_file(path, averaged=averaged)
    else:
        raise ConfigurationError(
            f"{path} is neither a lightscale checkpoint directory (.metadata, or DeepSpeed's checkpoint/) nor a "
            "checkpoint file; consolidate reads what a lightscale strategy saved."
        )
    consolidated = result.setdefault("lightscale", {}).setdefault("consolidated", {"optimizers": None, "missing": None})
    if with_optimizer and consolidated["missing"] is not None:
        raise ConfigurationError(f"{consolidated['missing']}; consolidate it without --with-optimizer.")
    if not with_optimizer:
        result.pop("optimizer_states", None)
        consolidated["missing"] = f"{output} was {WITHOUT_OPTIMIZER}"
    target = checkpoint_location(output)
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
    save_atomically(result, target)  # remote: one object, written whole
    return result


def _read_file(path: Location, *, averaged: bool) -> dict[str, Any]:
    """A Lightning file; ``averaged=False`` turns a WeightAveraging file (average as ``state_dict``, raw weights as
    ``current_model_state``: Lightning's convention) into the raw weights alone, as for a directory."""
    loaded = load_weights_only(path)
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), dict):
        raise ConfigurationError(f"{path} is not a Lightning checkpoint (no 'state_dict'); consolidate cannot read it.")
    if averaged:
        return loaded
    raw, _, _ = from_lightning_convention(loaded)
    return {**without_lightning_entries(loaded), "state_dict": raw}


def consolidate_command(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="lightscale consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint saved by any lightscale strategy (e.g. last.ckpt)")
    parser.add_argument("output", help="the Lightning checkpoint file to write (e.g. model.ckpt)")
    parser.add_argument("--with-optimizer", action="store_true", help="include the optimizer state (fit can resume)")
    parser.add_argument("--raw", action="store_true", help="leave a WeightAveraging average out: the raw weights")
    parsed = parser.parse_args(args)
    try:
        result = consolidate(
            parsed.checkpoint, parsed.output, with_optimizer=parsed.with_optimizer, averaged=not parsed.raw
        )
    except (FileNotFoundError, ValueError) as error:  # ConfigurationError is a ValueError
        raise SystemExit(f"error: {error}") from None
    optimizers = len(result.get("optimizer_states", []))
    print(f"wrote {parsed.output}: {len(result['state_dict'])} tensors, {optimizers} optimizer state(s)")
