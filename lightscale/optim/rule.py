"""Which optimizers run with the same math as one process under which strategy, checked before the first step.

An elementwise optimizer (SGD, Adam, Adagrad...) steps every element of a parameter on its own, so it runs the same on
a whole parameter, a DTensor shard or a flat partition. A *shape-dependent* one reads a parameter's shape or reduces
across it: torch's Adafactor (second moments factored over the last two dimensions, update scaled by whole-tensor
norms) and Muon (Newton-Schulz orthogonalization of each matrix). Such an optimizer is exact only where it sees the
parameter as one process would. Each strategy class says how its optimizer sees parameters (``parameter_view``):

* ``"whole"``: every rank steps whole parameters (bucketed_ddp, DiLoCo over bucketed_ddp): every optimizer is exact.
* ``"dtensor"``: parameters are DTensors sharded across ranks (the FSDP2 family, parallel_3d): torch's Adafactor is
  stepped by :class:`~lightscale.optim.adafactor.ShardedAdafactor` (its statistics completed across the shards; torch's
  own step fails on DTensor), torch's Muon by :class:`~lightscale.optim.muon.ShardedMuon` (each matrix orthogonalized
  whole, once, by an owner rank; torch's own runs on every rank through DTensor's sharded bf16 products, which round
  differently); a user's own shape-dependent optimizer is refused.
* ``"flat_mapped"``: DeepSpeed steps flat 1-D fp32 partitions, and lightscale reads where each parameter lies in them
  (strategies/deepspeed/partition.py): ZeRO-1/2 lay each group's parameters end to end, ZeRO-3 each parameter's own
  partition end to end (zero1, zero2, zero3 and their offload names). torch's Muon is stepped by
  :class:`~lightscale.optim.flat_muon.FlatMuon` (each matrix gathered whole to an owner rank for Newton-Schulz);
  Adafactor (its factored state would need the matrices' rows on one rank) and a user's own are refused.
* ``"flat"``: DeepSpeed steps flat 1-D partitions it may swap to NVMe (ZeRO-Infinity; fit_memory, which may become
  any ZeRO name): every shape-dependent optimizer is refused.

A combination of optimizers (lightscale/optim/combined.py) is checked part by part: under ``"flat_mapped"`` DeepSpeed
makes one flat partition per group and steps one group at a time, and each part steps its own groups' partitions.
Under ``"flat"`` (ZeRO-Infinity) a combination is refused: DeepSpeed's NVMe swapper moves each sub-group's state in
and out of the optimizer around its step, which no test here covers for a combination (NVMe swapping needs
DeepSpeed's async I/O library).

A user's own optimizer says it is shape-dependent with a class attribute::

    class MyShampoo(torch.optim.Optimizer):
        shape_dependent = True  # lightscale refuses it where parameters are sharded or flattened
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import torch

from lightscale.errors import ConfigurationError

ParameterView = Literal["whole", "dtensor", "flat_mapped", "flat"]
VIEWS: dict[ParameterView, str] = {
    "whole": "every rank steps whole parameters",
    "dtensor": "parameters are DTensors sharded across ranks",
    "flat_mapped": "DeepSpeed steps flat 1-D partitions of the parameters",
    "flat": "DeepSpeed steps flat 1-D partitions of the parameters, which it may swap to NVMe files",
}
# torch's shape-dependent optimizers, by class, with what their step reads.
KNOWN: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.Adafactor: "second moments factored over the last two dimensions, updates scaled by whole-tensor norms",
    torch.optim.Muon: "Newton-Schulz orthogonalization of each 2-D matrix",
}
# The ones a sharded view runs exactly, by view (lightscale/optim/install.py steps them): "dtensor" as ShardedAdafactor
# and ShardedMuon, "flat_mapped" (ZeRO but Infinity) as FlatMuon; "flat" none.
EXACT: dict[ParameterView, tuple[type[torch.optim.Optimizer], ...]] = {
    "dtensor": (torch.optim.Adafactor, torch.optim.Muon),
    "flat_mapped": (torch.optim.Muon,),
}
ATTRIBUTE = "shape_dependent"


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer`` itself, or the optimizers a combinator holds (its ``optimizers`` attribute), flattened."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, (list, tuple)) and inner and all(isinstance(o, torch.optim.Optimizer) for o in inner):
        return [leaf for o in inner for leaf in inner_optimizers(o)]
    return [optimizer]


def shape_dependence(optimizer: torch.optim.Optimizer) -> str | None:
    """What ``optimizer``'s step reads of a parameter's shape, or None for an elementwise optimizer."""
    for known, reads in KNOWN.items():
        if isinstance(optimizer, known):
            return reads
    if getattr(type(optimizer), ATTRIBUTE, False):
        return f"it declares `{ATTRIBUTE} = True`"
    return None


def runs_exactly(optimizer: torch.optim.Optimizer, view: ParameterView) -> bool:
    """Whether a strategy whose optimizer sees ``view`` runs ``optimizer`` with the same math as one process."""
    if view == "whole" or shape_dependence(optimizer) is None:
        return True
    return type(optimizer) in EXACT.get(view, ())


def check_optimizers(
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    view: ParameterView,
    strategy: str,
    names_by_view: Callable[[], dict[str, ParameterView]],
) -> None:
    """Refuse an optimizer ``strategy`` would silently run as a different one, naming the names where it is exact.

    ``names_by_view`` gives every registered strategy name and its view (called only to write the error).
    """
    for optimizer in optimizers:
        for leaf in inner_optimizers(optimizer):
            if not runs_exactly(leaf, view):
                _refuse_shape_dependent(leaf, view, strategy, names_by_view())
        if view == "flat" and inner_optimizers(optimizer) != [optimizer]:
            _refuse_combined(optimizer, strategy, names_by_view())


def _refuse_shape_dependent(
    leaf: torch.optim.Optimizer, view: ParameterView, strategy: str, names: dict[str, ParameterView]
) -> None:
    exact = [name for name, known in names.items() if runs_exactly(leaf, known)]
    cls = type(leaf)
    raise ConfigurationError(
        f"{cls.__module__}.{cls.__name__} cannot run under {strategy} with the same math as one process: "
        f"its step depends on each parameter's shape ({shape_dependence(leaf)}), and under {strategy} "
        f"{VIEWS[view]}. It runs exactly under: {', '.join(exact)}. (lightscale detects torch.optim.Adafactor "
        f"and torch.optim.Muon by class; an optimizer of your own opts in with the class attribute "
        f"`{ATTRIBUTE} = True`.)"
    )


def _refuse_combined(optimizer: torch.optim.Optimizer, strategy: str, names: dict[str, ParameterView]) -> None:
    """ZeRO-Infinity swaps each sub-group's optimizer state to NVMe around its step: untested for a combination."""
    parts = inner_optimizers(optimizer)
    exact = [name for name, view in names.items() if view != "flat" and all(runs_exactly(p, view) for p in parts)]
    raise ConfigurationError(
        f"{type(optimizer).__name__} of {', '.join(type(p).__name__ for p in parts)} cannot run under {strategy}: "
        f"ZeRO-Infinity swaps the optimizer's state to NVMe files around each step, which is not verified for a "
        f"combination of optimizers. Use one optimizer with a parameter group per part, or a name where it runs "
        f"exactly: {', '.join(exact)}."
    )
