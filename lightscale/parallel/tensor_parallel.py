"""Tensor parallelism as a plan: a dict from module-name pattern to a torch ``ParallelStyle``, validated, then applied.

A plan names modules by their fully qualified names, with ``*`` matching one name component
(``"layers.*.attention.wq"``), and maps each to a style from ``torch.distributed.tensor.parallel``:
``ColwiseParallel`` / ``RowwiseParallel`` for the Megatron split of attention and MLP (one all-reduce per block in
forward and one in backward), ``SequenceParallel`` for norms (activations sharded on the sequence between blocks),
``PrepareModuleInput`` to change an activation's layout at a module boundary. Models stay single-device; a model
ships its plan beside it (the GPT plan is ``lightscale/recipes/gpt/parallelize.py``).

Example:
    >>> plan = {"layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w2": RowwiseParallel()}
    >>> apply_tp_plan(model, mesh["tp"], plan)
"""

from __future__ import annotations

import difflib
import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightscale.errors import ConfigurationError
from lightscale.parallel.ties import retie, tied_parameters

TPPlan = dict[str, ParallelStyle]
_SHARDABLE = (nn.Linear, nn.Embedding)  # what Colwise/Rowwise know how to shard


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of ``model``'s submodules matched by ``pattern`` (``*`` matches one dotted component)."""
    atoms = pattern.split(".")
    return [
        name
        for name, _ in model.named_modules()
        if name and len(name.split(".")) == len(atoms) and all(map(fnmatch.fnmatchcase, name.split("."), atoms))
    ]


def validate_tp_plan(model: nn.Module, plan: TPPlan) -> None:
    """Raise ConfigurationError for patterns that match nothing, non-style values, or styles on unshardable modules."""
    names = [name for name, _ in model.named_modules() if name]
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise ConfigurationError(
                f"TP plan entry {pattern!r} maps to {type(style).__name__}, not a ParallelStyle; use ColwiseParallel, "
                "RowwiseParallel, SequenceParallel, PrepareModuleInput or PrepareModuleOutput."
            )
        matched = matching_modules(model, pattern)
        if not matched:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f" Close module names: {close}." if close else ""
            raise ConfigurationError(f"TP plan pattern {pattern!r} matches no module of {type(model).__name__}.{hint}")
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            wrong = [name for name in matched if not isinstance(modules[name], _SHARDABLE)]
            if wrong:
                raise ConfigurationError(
                    f"TP plan pattern {pattern!r} puts {type(style).__name__} on {wrong[0]!r} "
                    f"({type(modules[wrong[0]]).__name__}); it shards only nn.Linear and nn.Embedding."
                )


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, strict: bool = True) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` following ``plan``.

    ``strict=False`` skips patterns that match nothing, for pipeline stages that hold only part of the model
    (validate the plan against the whole model first).
    """
    if strict:
        validate_tp_plan(model, plan)
    ties = tied_parameters(model)
    present = {pattern: style for pattern, style in plan.items() if matching_modules(model, pattern)}
    parallelize_module(model, tp_mesh, present)
    _retie(model, ties)
    return model


def _retie(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Styles replace each module's parameters by new DTensors: point aliases at the one their original now is."""
    for alias, original in ties:
        source = model.get_parameter(original)
        target = model.get_parameter(alias)
        if getattr(target, "placements", None) != getattr(source, "placements", None):
            raise ConfigurationError(
                f"{alias} is tied to {original}, but the TP plan shards them differently "
                f"({getattr(target, 'placements', None)} vs {getattr(source, 'placements', None)}); shard both alike."
            )
    retie(model, ties)
