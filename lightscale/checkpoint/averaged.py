"""A weight average in checkpoints, both conventions: lightscale's (the average beside the weights) and Lightning's.

lightscale's layout keeps the raw weights as ``model.*`` and a ``WeightAveraging`` callback's average as
``averaged.*`` (lightscale/strategies/weight_averaging.py), its counter in ``trainer_state.pt``. Lightning's own
``WeightAveraging`` writes single files the other way round: ``state_dict`` is the average, ``current_model_state``
the raw weights, ``averaging_state`` the counter. Single files lightscale writes or makes (``checkpoint_format="file"``,
``lightscale consolidate``, ``load_from_checkpoint`` of a directory) follow Lightning's, so plain Lightning restores
both and ``load_from_checkpoint`` gives the average, as it would for a file Lightning wrote; reading such a file as
the layout (lightscale/checkpoint/portable_file.py) turns it back.

Example:
    >>> lightning_file = to_lightning_convention(checkpoint)   # state_dict: the average
    >>> raw, averaged, meta = from_lightning_convention(lightning_file)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

AVERAGED = "averaged_state_dict"  # the average's tensors in Lightning's checkpoint dict, written as ``averaged.*``
AVERAGED_META = "lightscale_weight_averaging"  # {"n_averaged": int}, kept in trainer_state.pt
_LIGHTNING = ("current_model_state", "averaging_state")  # Lightning's WeightAveraging entries


def to_lightning_convention(checkpoint: dict[str, Any], averaged: dict[str, Tensor] | None = None) -> dict[str, Any]:
    """``checkpoint`` (raw weights as ``state_dict``) with the average (``averaged``, else its ``AVERAGED`` entry)
    as Lightning's WeightAveraging writes it; unchanged when it holds no average."""
    average = averaged if averaged is not None else checkpoint.get(AVERAGED)
    meta = checkpoint.get(AVERAGED_META)
    rest = {key: value for key, value in checkpoint.items() if key not in (AVERAGED, AVERAGED_META)}
    if average is None or meta is None:
        return rest
    counter = {"n_averaged": torch.tensor(meta["n_averaged"], dtype=torch.long)}
    return {**rest, "state_dict": average, "current_model_state": checkpoint["state_dict"], "averaging_state": counter}


def from_lightning_convention(
    loaded: dict[str, Any],
) -> tuple[dict[str, Tensor], dict[str, Tensor] | None, dict[str, int] | None]:
    """The raw weights, the average and its counter of a Lightning file (no average: ``None, None``)."""
    if not all(key in loaded for key in _LIGHTNING):
        return loaded["state_dict"], None, None
    counter = {"n_averaged": int(loaded["averaging_state"]["n_averaged"])}
    return loaded["current_model_state"], loaded["state_dict"], counter


def without_lightning_entries(loaded: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in loaded.items() if key not in _LIGHTNING}
