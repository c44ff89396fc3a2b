"""DiLoCo's state in the portable layout: the global model as ``model.*``, every worker's own state beside it.

``model.<name>``: the fp32 global parameters (what ``lightscale export`` gives and every strategy loads).
``diloco.w<worker>.s<shard>.local.<name>`` / ``.inner.<index>.<key>``: a worker's local parameters and inner optimizer
state and compression residuals (``shard`` is the rank's position inside its worker when the inner strategy shards,
else 0, so identical copies are written once). ``diloco.s<shard>.*``: the outer state the workers share (outer
optimizer, results in flight, step and byte counters). The non-tensor rest (settings, inner ``param_groups``, what is
in flight) goes to ``trainer_state.pt`` under ``"diloco"``. Resuming needs the same workers and shards.

Example:
    >>> tensors, meta = diloco_state(sync, optimizer, worker=1, shard=0)
    >>> write_checkpoint(path, {"model": globals_, "diloco": tensors}, {**rest, "diloco": meta}, save_file)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightscale.checkpoint.layout import layout_entries, read_checkpoint
from lightscale.parallel.diloco import OuterSync

_PREFIX = "diloco."


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def diloco_state(
    sync: OuterSync, optimizer: Optimizer, *, worker: int, shard: int
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This rank's tensors (flat keys, see the module docstring) and the non-tensor rest for ``trainer_state.pt``."""
    own, outer = f"w{worker}.s{shard}.", f"s{shard}."
    tensors = {own + "local." + name: sync.local(i).clone() for i, name in enumerate(sync.names)}
    inner = optimizer.state_dict()
    for index, entries in inner["state"].items():
        tensors |= {f"{own}inner.{index}.{key}": _local(v) for key, v in entries.items() if isinstance(v, Tensor)}
    state = sync.state_dict()
    for f, fragment_state in enumerate(state["outer_optimizers"]):
        for index, entries in (fragment_state or {}).get("state", {}).items():
            tensors |= {f"{outer}outer.{f}.{index}.{key}": v for key, v in entries.items() if isinstance(v, Tensor)}
    tensors |= {f"{own}residual.{f}": r for f, r in enumerate(state["residuals"]) if r is not None}  # per worker
    tensors |= {f"{outer}pending.{i}": p["mean"] for i, p in enumerate(state["pending"])}
    tensors[outer + "counters"] = torch.tensor([state["step"], state["bytes_sent"]], dtype=torch.int64)
    meta = {
        "settings": state["settings"],
        "inner_param_groups": inner["param_groups"],
        "outer_param_groups": [s["param_groups"] if s else None for s in state["outer_optimizers"]],
        "pending": [{"fragment": p["fragment"], "apply_at": p["apply_at"]} for p in state["pending"]],
        "step": state["step"],
    }
    return tensors, meta


def read_diloco_state(path: Any, globals_: dict[str, Tensor], *, worker: int, shard: int) -> dict[str, Tensor]:
    """Collectively fill ``globals_`` (the ``model`` entries) and return this rank's ``diloco`` tensors of ``path``."""
    entries = layout_entries(path)
    mine = (f"w{worker}.s{shard}.", f"s{shard}.")
    template = {
        key[len(_PREFIX) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(_PREFIX) and key[len(_PREFIX) :].startswith(mine)
    }
    read_checkpoint(path, {"model": globals_, "diloco": template})
    return template


def load_diloco_state(
    sync: OuterSync, optimizer: Optimizer, tensors: dict[str, Tensor], meta: dict[str, Any], *, worker: int, shard: int
) -> None:
    """Restore what :func:`diloco_state` saved (the globals were read into ``sync`` by :func:`read_diloco_state`)."""
    own, outer = f"w{worker}.s{shard}.", f"s{shard}."
    with torch.no_grad():
        for i, name in enumerate(sync.names):
            sync.local(i).copy_(tensors[own + "local." + name])
    inner_state: dict[int, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(own + "inner."):
            index, name = key[len(own + "inner.") :].split(".", 1)
            inner_state.setdefault(int(index), {})[name] = value
    _load_inner(optimizer, inner_state, meta["inner_param_groups"])
    step, bytes_sent = tensors[outer + "counters"].tolist()
    outer_states = []
    for f, groups in enumerate(meta["outer_param_groups"]):
        state: dict[int, dict[str, Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith(f"{outer}outer.{f}."):
                index, name = key[len(f"{outer}outer.{f}.") :].split(".", 1)
                state.setdefault(int(index), {})[name] = value
        outer_states.append(None if groups is None else {"state": state, "param_groups": groups})
    sync.load_state_dict(
        {
            "settings": meta["settings"],
            "step": step,
            "bytes_sent": bytes_sent,
            "global_params": dict(sync.named_globals()),
            "outer_optimizers": outer_states,
            "residuals": [tensors.get(f"{own}residual.{f}") for f in range(len(sync.fragments))],
            "pending": [{**p, "mean": tensors[f"{outer}pending.{i}"]} for i, p in enumerate(meta["pending"])],
        }
    )


def _load_inner(optimizer: Optimizer, state: dict[int, dict[str, Tensor]], groups: list[dict[str, Any]]) -> None:
    """Load local tensors into the inner optimizer; its sharded (DTensor) states are refilled in place."""
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in state.items():
        param = params[index]
        for key, value in entries.items():
            if isinstance(param, DTensor) and value.dim() > 0:  # load_state_dict cast a local tensor: wrap it back
                optimizer.state[param][key] = DTensor.from_local(
                    value.to(param.device), param.device_mesh, param.placements, shape=param.shape,
                    stride=param.stride(),
                )  # fmt: skip
