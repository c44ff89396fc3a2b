"""Precision under FSDP2: the Trainer's precision name becomes a ``MixedPrecisionPolicy``, not autocast.

FSDP2 casts the all-gathered parameters to ``param_dtype`` for compute and reduces gradients in
``reduce_dtype``; the sharded parameters (master weights) and the optimizer stay fp32. So the Lightning
plugin only keeps the parts FSDP does not do: the loss scaler for fp16 (a ``ShardedGradScaler``, whose
inf/NaN check agrees across ranks) and gradient-norm clipping over the full, sharded gradient.

=============  ===================================  =====================
precision      MixedPrecisionPolicy                 loss scaling
=============  ===================================  =====================
``32-true``    fp32 everywhere                      none
``bf16-mixed`` bf16 params in compute, fp32 reduce  none
``16-mixed``   fp16 params in compute, fp32 reduce  ShardedGradScaler
``bf16-true``  bf16 everywhere (module converted)   none
=============  ===================================  =====================
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.parallel.fsdp import clip_grad_norm_
from lightscale.plugins.precision_contract import DTYPES, PRECISIONS, normalize_precision


def precision_name(plugin: Precision) -> str:
    """The precision name a Lightning plugin stands for (``32-true`` for the plain plugin)."""
    name = normalize_precision(getattr(plugin, "precision", "32-true"))
    if name not in PRECISIONS:
        raise ConfigurationError(
            f"precision={name!r} is not supported by lightscale's strategies; choose {', '.join(PRECISIONS[:-1])} or "
            f"{PRECISIONS[-1]}."
        )
    return name


def mp_policy(precision: str, compression: str = "none", *, cast_params: bool = True) -> MixedPrecisionPolicy:
    """The FSDP2 mixed-precision policy for a Trainer precision name (the contract in precision_contract.py).

    Mixed modes compute with parameters cast to bf16/fp16 and reduce gradients in fp32; ``compression`` reduces in
    bf16/fp16 instead. ``cast_params=False`` leaves compute to autocast (a pipeline stage) and sets only the reduction.
    """
    compute = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision) if cast_params else None
    reduce = DTYPES.get(compression) or (torch.float32 if compute is not None else None)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)


class _ShardedClipping:
    """Norm clipping over the full gradient: per-shard norms reduced across the mesh (DTensor)."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, float(clip_val))


class FSDP2Precision(_ShardedClipping, Precision):
    """fp32 training (FSDP's default policy), with clipping across shards."""


class FSDP2MixedPrecision(_ShardedClipping, MixedPrecision):
    """bf16/fp16 compute by FSDP's policy: no autocast; fp16 keeps a ``ShardedGradScaler``."""

    def __init__(self, precision: str, device: str) -> None:
        scaler = None
        if precision == "16-mixed":
            scaler = ShardedGradScaler(device=device)
        super().__init__(precision, device, scaler=scaler)  # type: ignore[arg-type]

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        yield  # FSDP casts parameters (and floating inputs) per unit; autocast would cast a second time


class FSDP2HalfPrecision(_ShardedClipping, HalfPrecision):
    """bf16-true: the module is converted to bf16 before sharding, as under any strategy."""


def fsdp2_precision_plugin(precision: str, device: str) -> Precision:
    """The plugin that goes with :func:`mp_policy` for ``precision``."""
    if precision in ("bf16-mixed", "16-mixed"):
        return FSDP2MixedPrecision(precision, device)
    if precision == "bf16-true":
        return FSDP2HalfPrecision("bf16-true")
    return FSDP2Precision()


class MixedTensorGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` (one skip-or-step decision over all ranks) for a model whose parameters are partly
    DTensors (layers in the tensor-parallel plan) and partly plain tensors (the rest): torch's fused unscale kernel
    refuses such a mix in one call, so each kind is unscaled by its own call into the same found-inf flag.

    Example:
        >>> MixedPrecision("16-mixed", "cpu", scaler=MixedTensorGradScaler(device="cpu"))
    """

    @override
    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        kinds: dict[bool, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                kinds.setdefault(isinstance(param, DTensor), []).append(param)
        flags: dict[torch.device, torch.Tensor] = {}
        for params in kinds.values():  # the found-inf tensor per device is shared: both calls set the same flag
            view = SimpleNamespace(param_groups=[{"params": params}])
            flags.update(super()._unscale_grads_(view, inv_scale, found_inf, allow_fp16))  # type: ignore[arg-type]
        return flags
