"""Refuse a checkpoint of a differently shaped model before loading it, naming the keys and both shapes.

torch reports a mismatch as a ``RuntimeError`` listing every key of a strict load (single file), and DCP as a
planner error from inside a collective (sharded directories). Comparing the saved shapes with the model's first
gives one message in both cases, before any tensor is copied and before the first training step.

Example:
    >>> check_shapes({"model.wte.weight": (256, 32)}, {"model.wte.weight": (256, 64)}, "last.ckpt")
    ConfigurationError: last.ckpt was saved from a differently shaped model: model.wte.weight: checkpoint
    (256, 32), model (256, 64). ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from lightscale.errors import ConfigurationError

_SHOWN = 5
# A tensor's global shape: the strategy's answer (lightscale/strategies/shards.py ``global_shape``; a ZeRO-3 partition
# is empty in place), passed in from above; a plain tensor's or a DTensor's own shape by default.
ShapeOf = Callable[[Tensor], Sequence[int]]


def own_shape(tensor: Tensor) -> Sequence[int]:
    return tensor.shape


def check_shapes(saved: Mapping[str, Sequence[int]], model: Mapping[str, Sequence[int]], source: str) -> None:
    """Raise a ConfigurationError naming the first keys whose saved shape differs from the model's (global) shape.

    Keys present on one side only are left to the loader's own strict/non-strict handling.
    """
    mismatched = [
        f"{key}: checkpoint {tuple(shape)}, model {tuple(model[key])}"
        for key, shape in saved.items()
        if key in model and tuple(shape) != tuple(model[key])
    ]
    if mismatched:
        more = f" (and {len(mismatched) - _SHOWN} more)" if len(mismatched) > _SHOWN else ""
        raise ConfigurationError(
            f"{source} was saved from a differently shaped model: {'; '.join(mismatched[:_SHOWN])}{more}. Build the "
            "model with the configuration it was saved with, or start without ckpt_path."
        )


def tensor_shapes(state: Mapping[str, Any], *, shape_of: ShapeOf = own_shape) -> dict[str, tuple[int, ...]]:
    """The (global) shape of every tensor entry of a state dict, as ``shape_of`` answers it."""
    return {key: tuple(shape_of(value)) for key, value in state.items() if isinstance(value, Tensor)}


def check_state_dict_shapes(
    saved: Mapping[str, Any], model: Mapping[str, Any], source: str, *, shape_of: ShapeOf = own_shape
) -> None:
    """:func:`check_shapes` of two state dicts (e.g. a single-file checkpoint's ``state_dict`` and the model's, whose
    global shapes ``shape_of`` answers: the strategy's ``global_shape``)."""
    check_shapes(tensor_shapes(saved), tensor_shapes(model, shape_of=shape_of), source)
