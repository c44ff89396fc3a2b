"""float8 training by torchao: eligible ``nn.Linear`` layers become ``Float8Linear``, applied from outside the model.

:func:`apply_float8` runs first on the one parallelize path (before TP and FSDP, as in torchtitan): it swaps each
eligible Linear for torchao's ``Float8Linear``, whose matmuls cast input, weight and output gradient to float8
with dynamic scales (``tensorwise``: one scale per tensor; ``rowwise``: one per row, power-of-2 scales) and return
the result in the input's dtype. A Linear is left as it is, and named once in a warning, when its two sizes are not
both multiples of 16 x tp (float8 GEMMs need 16-aligned local shapes) or when its weight is shared with another
module (tied embeddings: the embedding lookup does not run in float8, and the FSDP float8 wrapper would untie it).

With FSDP sharding and the ``tensorwise`` recipe, weights are all-gathered in float8 (``enable_fsdp_float8_all_gather``:
1 byte per element instead of 2 in bf16) and their scales are computed for all layers by one all-reduce after each
optimizer step (:func:`precompute_float8_scales`). Under TP the converted layers take torchao's float8 TP styles
(``Float8ColwiseParallel`` / ``Float8RowwiseParallel``: their activation collectives run in float8 too;
``tensorwise`` only, as torchao supports them, and on CUDA only: gloo cannot move float8 tensors).

``emulate=True`` runs torchao's emulation (float8 rounding, matmuls in high precision): the only mode on a CPU or
a GPU without float8 tensor cores, for numerics and integration tests, slower than bf16.

torchao is the optional extra ``lightscale[float8]``, imported only when float8 is asked for.

Example:
    >>> apply_float8(model, Float8Options(recipe="tensorwise", emulate=True), fsdp_all_gather=False)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightscale.errors import ConfigurationError, import_extra

RECIPES = ("tensorwise", "rowwise")
SIZE_MULTIPLE = 16


@dataclass(frozen=True)
class Float8Options:
    """Which torchao recipe converts the Linear layers, and whether its matmuls are emulated."""

    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ConfigurationError(f"float8 recipe={self.recipe!r} is not valid; choose one of {', '.join(RECIPES)}.")


def torchao_float8() -> ModuleType:
    """``torchao.float8``, or a ConfigurationError naming the extra that installs it."""
    return import_extra("torchao.float8", "float8", error=ConfigurationError)


def float8_config(options: Float8Options, *, fsdp_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``options``; float8 all-gather only where torchao has it (tensorwise)."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(options.recipe)
    all_gather = fsdp_all_gather and options.recipe == "tensorwise"
    return dataclasses.replace(config, emulate=options.emulate, enable_fsdp_float8_all_gather=all_gather)


def ineligible_linears(model: nn.Module, *, tp: int = 1) -> dict[str, str]:
    """The Linear layers float8 leaves alone, by name, with the reason."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    multiple = SIZE_MULTIPLE * tp
    skipped = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module.in_features % multiple or module.out_features % multiple:
            skipped[name] = f"{module.in_features} x {module.out_features} not multiples of {multiple}"
        elif owners[id(module.weight)] > 1:
            skipped[name] = "weight shared with another module (tied)"
    return skipped


def apply_float8(model: nn.Module, options: Float8Options, *, fsdp_all_gather: bool, tp: int = 1) -> list[str]:
    """Swap ``model``'s eligible Linear layers for torchao ``Float8Linear`` in place; return the converted names.

    Call before TP and FSDP. The layers left in high precision are named once in a warning (rank 0)."""
    float8 = torchao_float8()
    skipped = ineligible_linears(model, tp=tp)
    converted = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in skipped]
    config = float8_config(options, fsdp_all_gather=fsdp_all_gather)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name not in skipped)
    if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
        listed = "; ".join(f"{name} ({why})" for name, why in skipped.items())
        warnings.warn(f"lightscale float8: {len(skipped)} Linear layers stay in bf16: {listed}.", stacklevel=2)
    return converted


def float8_tp_plan(
    plan: dict[str, Any], network: nn.Module, options: Float8Options, *, device_type: str
) -> dict[str, Any]:
    """``plan`` with the column/row-wise styles of converted layers replaced by torchao's float8 TP styles.

    Only for tensorwise (torchao's float8 TP styles assume one scale per tensor) and on CUDA: gloo, the CPU
    backend, has no float8 dtype, so on CPU the converted layers keep the plain styles (activations move in bf16).
    """
    if options.recipe != "tensorwise" or device_type != "cuda":
        return plan
    torchao_float8()  # the extra's error if missing
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    names = dict(network.named_modules())
    swapped = {}
    for pattern, style in plan.items():
        matched = [module for name, module in names.items() if fnmatch.fnmatchcase(name, pattern)]
        converted = bool(matched) and all(isinstance(m, Float8Linear) for m in matched)
        kind = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
        swapped[pattern] = kind(**_style_arguments(style)) if converted and kind is not None else style
    return swapped


def _style_arguments(style: ColwiseParallel | RowwiseParallel) -> dict[str, Any]:
    return {
        "input_layouts": style.input_layouts[0],
        "output_layouts": style.output_layouts[0],
        "use_local_output": style.use_local_output,
    }


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every FSDP-sharded float8 weight, by one all-reduce (no-op
    when no weight is all-gathered in float8)."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
