"""Model-state bytes per rank from a parameter count: the ZeRO paper's arithmetic, for every lightscale layout.

With Ψ parameters, mixed-precision Adam holds 2Ψ (half parameters) + 2Ψ (half gradients) + KΨ (fp32 master copy
and two moments, K = 12) = 16Ψ bytes; ZeRO-1 shards the K part over N ranks (4Ψ + 12Ψ/N), ZeRO-2 the gradients
too (2Ψ + 14Ψ/N), ZeRO-3 everything (16Ψ/N). Which bytes each engine keeps per precision is in
:func:`bytes_per_parameter`: DeepSpeed always keeps an fp32 master copy (K = 12), torch's own optimizers keep their
moments in the parameters' dtype and the parameters themselves are the master copy.

Example:
    >>> zero_stage_bytes(7_500_000_000, world_size=64, stage=1) / 1e9  # ZeRO paper, Figure 1
    31.40625
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightscale.estimate.memory_layout import Layout

# Trainer precision -> bytes of one parameter as the module holds it.
_PARAM_BYTES = {"32-true": 4, "32": 4, "bf16-mixed": 4, "16-mixed": 4, "bf16-true": 2, "16-true": 2}
# Trainer precision -> bytes of one parameter as FSDP2 gathers it for compute (its param_dtype); others fp32.
_COMPUTE_BYTES = {"bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2}
_DEEPSPEED_PARAM_BYTES = {"32-true": 4, "32": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2}


@dataclass(frozen=True)
class PerParameter:
    """Bytes per parameter of each kind of model state (``optimizer`` is the ZeRO paper's K)."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class Placed:
    """Bytes of one category on the accelerator and in host memory (offload)."""

    device: float = 0.0
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.device + self.host


@dataclass(frozen=True)
class ModelStates:
    parameters: Placed
    gradients: Placed
    optimizer: Placed


def bytes_per_parameter(precision: str, *, engine: str, optimizer_states: int = 2) -> PerParameter:
    """Bytes per parameter for ``engine`` (``torch`` or ``deepspeed``) under a Trainer precision name.

    ``optimizer_states`` is how many tensors the size of the parameters the optimizer keeps (Adam: 2, SGD with
    momentum: 1). DeepSpeed adds its fp32 master copy, so Adam there is always K = 12.
    """
    table = _DEEPSPEED_PARAM_BYTES if engine == "deepspeed" else _PARAM_BYTES
    if precision not in table:
        raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(table)}")
    size = table[precision]
    if engine == "deepspeed":
        return PerParameter(size, size, 4 + 4 * optimizer_states)
    return PerParameter(size, size, size * optimizer_states)


def zero_stage_bytes(num_params: int, *, world_size: int, stage: int, per: PerParameter | None = None) -> float:
    """Model-state bytes per rank at ZeRO ``stage`` (0-3) with mixed-precision Adam unless ``per`` says otherwise."""
    per = per or PerParameter(2, 2, 12)
    shards = (
        (False, False, False),
        (False, False, True),
        (False, True, True),
        (True, True, True),
    )[stage]
    parts = (per.parameters, per.gradients, per.optimizer)
    return sum(num_params * b / (world_size if s else 1) for b, s in zip(parts, shards, strict=True))


def model_states(
    sizes: Sequence[int],
    layout: Layout,
    per: PerParameter,
    *,
    extra_gradient_elements: int = 0,
    expert_sizes: Sequence[int] = (),
) -> ModelStates:
    """Bytes of parameters, gradients and optimizer state one rank holds, given its parameter tensors' sizes
    (after tensor, pipeline and expert splits: see :func:`~lightscale.estimate.parameters.rank_parameter_split`).
    Dense tensors shard over ``layout.dp_shard`` ranks, routed experts over ``layout.expert_shard``."""
    n = layout.dp_shard
    total = sum(sizes) + sum(expert_sizes)
    # dim-0 chunks: the first ranks get the rounded-up size
    sharded = sum(math.ceil(size / n) for size in sizes)
    sharded += sum(math.ceil(size / layout.expert_shard) for size in expert_sizes)
    persistent = sum(size for size in sizes if size <= layout.persistence_threshold)
    params = (sharded + persistent if layout.shard_parameters else total) * per.parameters
    grads = ((sharded if layout.shard_gradients else total) + extra_gradient_elements) * per.gradients
    optim = (sharded if layout.shard_optimizer else total) * per.optimizer
    optim += (sharded if layout.shard_parameters else total) * layout.outer_state_bytes
    # Offloaded optimizers step on the host, so the (sharded) gradients they read live there too.
    grads_on_host = layout.offload_optimizer and layout.shard_gradients
    return ModelStates(
        parameters=_place(params, host=layout.offload_parameters),
        gradients=_place(grads, host=grads_on_host),
        optimizer=_place(optim, host=layout.offload_optimizer),
    )


def secondary_shard_bytes(unit_shapes: Sequence[Sequence[int]], layout: Layout, precision: str) -> int:
    """ZeRO++ hpZ's extra parameter bytes per rank: from forward to backward every unit keeps 1/S of each
    parameter's all-gather output (dim 0 padded to a multiple of ``dp_shard``) in the compute dtype, S =
    ``layout.secondary_shard`` (torch's ``FSDPParam.to_sharded_post_forward``); 0 without secondary shards."""
    n, s = layout.dp_shard, layout.secondary_shard
    if s <= 1 or not layout.shard_parameters:
        return 0
    padded = [math.ceil(shape[0] / n) * n * math.prod(shape[1:]) for shape in unit_shapes]
    return sum(numel // s for numel in padded) * _COMPUTE_BYTES.get(precision, 4)


def _place(nbytes: float, *, host: bool) -> Placed:
    return Placed(host=nbytes) if host else Placed(device=nbytes)
