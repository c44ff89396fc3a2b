"""What DiLoCo's checkpoints read of the live run: the fp32 global model under the module's names (the ``model.*``
entries), and whether a checkpoint resumes exactly at this layout or restarts every worker from the global model.
The layout on disk is lightscale/checkpoint/diloco_state.py's.

Example:
    >>> global_model(module, outer)  # {"net.0.weight": <the global copy>, ..., "net.1.running_mean": ...}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightscale.checkpoint.diloco_state import like_param
from lightscale.errors import ConfigurationError
from lightscale.parallel.diloco import OuterSync


def global_model(module: nn.Module, outer: OuterSync) -> dict[str, torch.Tensor]:
    """The module's whole ``state_dict`` with the parameters' fp32 global copies: a tied parameter under each of its
    names (a file without the second name misses a key in ``load_state_dict``), DTensors over the worker's shards
    when FSDP2 shards; the persistent buffers (the same on every rank) as they are, filled in place on load."""
    pairs = zip(outer.params, outer.named_globals(), strict=True)
    by_param = {id(param): like_param(param, tensor) for param, (_, tensor) in pairs}
    named = list(module.named_parameters(remove_duplicate=False))
    params = {name: by_param[id(param)] for name, param in named if id(param) in by_param}
    own = {name for name, _ in named}
    state = module.state_dict(keep_vars=True)
    buffers = {name: t for name, t in state.items() if name not in own and isinstance(t, torch.Tensor)}
    return {**params, **buffers}


def refuse_single_file(path: Path) -> None:
    """DiLoCo resumes from its portable layout only: a single file holds no worker's own state."""
    if path.is_file():
        raise ConfigurationError(
            f"{path} is a single file; DiLoCo resumes from its portable layout (checkpoint_format='dcp'), which "
            "holds every worker's own state. Evaluate the file, or start a new run from its weights (InitWeights)."
        )


def resumes_exactly(path: Path, saved: dict[str, Any] | None, *, workers: int, shards: int) -> bool:
    """Whether the checkpoint at ``path`` (its saved DiLoCo state) resumes exactly at ``workers`` x ``shards`` (else
    every worker restarts from the global model); refuses a checkpoint without DiLoCo state, and outer results in
    flight at another layout."""
    if saved is None:
        raise ConfigurationError(
            f"{path} was not saved by DiLoCo, so it holds no outer state to resume; load its model into a new run "
            f"with `lightscale export` (or train on with the strategy that saved it)."
        )
    same = (saved["workers"], saved.get("shards", 1)) == (workers, shards)
    if not same and saved["pending"]:
        raise ConfigurationError(
            f"{path} was saved with {len(saved['pending'])} outer result(s) in flight (overlap_steps > 0), which "
            f"only the saved layout ({saved['workers']} workers x {saved.get('shards', 1)} shards) can apply; "
            f"resume it with that layout, or at another number of workers from a checkpoint saved right after "
            f"a fragment's result landed."
        )
    return same
