"""Every rank's random state in the checkpoint, so a resumed run draws the dropout masks it would have drawn.

Lightning's checkpoint carries no RNG state; each rank's generators differ (dropout under data parallelism draws
different masks per rank), so the states of all ranks are gathered into ``trainer_state.pt`` and each rank takes
its own back at load. Stored as tensors, ints and tuples only (numpy's state array becomes a tensor), so the file
stays loadable with ``weights_only=True``. At another world size there is no rank-to-rank mapping: the states are
left as they are, with a warning saying so.

Example:
    >>> states = gather_rng_states()  # collective: every rank calls it
    >>> restore_rng_states(states)    # each rank sets states[rank]
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def process_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), numpy and Python random states, in weights-only-loadable types."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "python": (version, list(internal), gauss),
    }


def set_process_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["torch.cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch.cuda"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`process_rng_state`, indexed by rank (collective when a process group exists)."""
    state = process_rng_state()
    if not dist.is_initialized():
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


def restore_rng_states(states: list[dict[str, Any]] | None) -> bool:
    """Set this rank's saved state; returns False (and warns) when the checkpoint has none for this world size."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if not states:
        return False
    if len(states) != world:
        rank_zero_warn(
            f"The checkpoint holds random states for {len(states)} ranks and this run has {world}: random states "
            "are not restored, so dropout masks and random augmentations will differ from an uninterrupted run."
        )
        return False
    set_process_rng_state(states[rank])
    return True
