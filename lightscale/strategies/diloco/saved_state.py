"""DiLoCo's state in the portable layout: the global model as ``model.*``, every worker's own state beside it.

``model.<name>``: the fp32 global parameters (what ``lightscale export`` gives and every strategy loads).
``diloco.outer.<name>.<key>``: the outer optimizer's state of that parameter (Nesterov momentum), stored like the
global model (a DTensor over the worker's shards under FSDP2), so both load at any number of workers and shards.
``diloco.w<worker>.s<shard>.local.<name>`` / ``.inner.<index>.<key>``: a worker's local parameters and inner optimizer
state and compression residuals (``shard`` is the rank's position inside its worker when the inner strategy shards,
else 0, so identical copies are written once). ``diloco.s<shard>.*``: the rest of the outer state (results in
flight, step and byte counters, scalar optimizer states). The non-tensor rest (settings, inner ``param_groups``, what
is in flight) goes to ``trainer_state.pt`` under ``"diloco"``. An exact resume needs the same workers and shards;
:func:`load_global_state` restarts any other layout from the global model and the outer state.

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

from lightscale.checkpoint.portable import layout_entries, read_checkpoint
from lightscale.parallel.diloco import OuterSync

_PREFIX = "diloco."
_OUTER = "outer."


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like_param(param: Tensor, local: Tensor) -> Tensor:
    """``local`` (this rank's values of ``param``) as a tensor of the whole model: a DTensor when ``param`` is one."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


def _outer_entries(sync: OuterSync) -> list[tuple[int, int, int]]:
    """``(fragment, index in the fragment's optimizer, index in sync.params)`` for every outer-optimized tensor."""
    return [(f, i, p) for f, fragment in enumerate(sync.fragments) for i, p in enumerate(fragment.indices)]


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
    for f, index, p in _outer_entries(sync):
        entries = (state["outer_optimizers"][f] or {}).get("state", {}).get(index, {})
        for key, value in entries.items():
            if isinstance(value, Tensor) and value.dim():  # shaped like the parameter's shard: stored like it
                tensors[f"{_OUTER}{sync.names[p]}.{key}"] = like_param(sync.params[p], value)
            elif isinstance(value, Tensor):
                tensors[f"{outer}outer.{f}.{index}.{key}"] = value
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


def read_diloco_state(
    path: Any, sync: OuterSync, globals_: dict[str, Tensor], *, worker: int | None, shard: int
) -> dict[str, Tensor]:
    """Collectively fill ``globals_`` (the ``model`` entries) and return this rank's ``diloco`` tensors of ``path``:
    the outer state, and (``worker`` not None) this worker's own."""
    entries = layout_entries(path)
    mine = (f"w{worker}.s{shard}.", f"s{shard}.") if worker is not None else ()
    by_name = {name: i for i, name in enumerate(sync.names)}
    template: dict[str, Tensor] = {}
    for full_key, meta in entries.items():
        key = full_key[len(_PREFIX) :]
        if full_key.startswith(_PREFIX + _OUTER):
            index = by_name[key[len(_OUTER) :].rsplit(".", 1)[0]]
            template[key] = like_param(sync.params[index], torch.zeros_like(sync.local(index), dtype=torch.float32))
        elif full_key.startswith(_PREFIX) and key.startswith(mine):
            template[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    read_checkpoint(path, {"model": globals_, "diloco": template})
    return {key: _local(value) for key, value in template.items()}


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
    sync.load_state_dict(
        {
            "settings": meta["settings"],
            "step": step,
            "bytes_sent": bytes_sent,
            "global_params": dict(sync.named_globals()),
            "outer_optimizers": _outer_states(sync, tensors, meta, scalars=outer),
            "residuals": [tensors.get(f"{own}residual.{f}") for f in range(len(sync.fragments))],
            "pending": [{**p, "mean": tensors[f"{outer}pending.{i}"]} for i, p in enumerate(meta["pending"])],
        }
    )


def load_global_state(sync: OuterSync, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Resume at another number of workers or shards: every worker restarts from the global model with the outer
    state (read by :func:`read_diloco_state` with ``worker=None``); inner optimizer and residuals start afresh."""
    sync.load_state_dict(
        {
            "settings": meta["settings"],
            "step": meta["step"],
            "bytes_sent": 0,  # this rank's count restarts: it is per rank, and the ranks changed
            "global_params": dict(sync.named_globals()),
            "outer_optimizers": _outer_states(sync, tensors, meta, scalars=None),
            "residuals": [None] * len(sync.fragments),
            "pending": [],
        }
    )
    with torch.no_grad():
        for i, (_, tensor) in enumerate(sync.named_globals()):
            sync.local(i).copy_(tensor)


def _outer_states(
    sync: OuterSync, tensors: dict[str, Tensor], meta: dict[str, Any], *, scalars: str | None
) -> list[dict[str, Any] | None]:
    states: list[dict[int, dict[str, Tensor]]] = [{} for _ in sync.fragments]
    for f, index, p in _outer_entries(sync):
        prefix = f"{_OUTER}{sync.names[p]}."
        for key, value in tensors.items():
            if key.startswith(prefix) and "." not in key[len(prefix) :]:
                states[f].setdefault(index, {})[key[len(prefix) :]] = value
            elif scalars is not None and key.startswith(f"{scalars}outer.{f}.{index}."):
                states[f].setdefault(index, {})[key[len(f"{scalars}outer.{f}.{index}.") :]] = value
    groups = meta["outer_param_groups"]
    return [None if g is None else {"state": s, "param_groups": g} for s, g in zip(states, groups, strict=True)]


def _load_inner(optimizer: Optimizer, state: dict[int, dict[str, Tensor]], groups: list[dict[str, Any]]) -> None:
    """Load local tensors into the inner optimizer; its sharded (DTensor) states are refilled in place."""
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in state.items():
        param = params[index]
        for key, value in entries.items():
            if isinstance(param, DTensor) and value.dim() > 0:  # load_state_dict cast a local tensor: wrap it back
                optimizer.state[param][key] = DTensor.from_local(
                    value.to(param.device),
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                )
