"""Precision under FSDP2: the Trainer's precision name becomes a ``MixedPrecisionPolicy``, not autocast.

FSDP2 casts the all-gathered parameters to ``param_dtype`` for compute and reduces gradients in
``reduce_dtype``; the sharded parameters (master weights) and the optimizer stay fp32. So the Lightning
plugin only keeps the parts FSDP does not do: the loss scaler for fp16 (a ``ShardedGradScaler``, whose
inf/NaN check agrees across ranks) and gradient-norm clipping over the full, sharded gradient
(:func:`clip_grad_norm_`). ``parallel_3d`` runs the same plugins (:func:`parallel_3d_precision_plugin`), with autocast
where FSDP does not cast, and clips over the pipeline group too: Lightning clips through the precision plugin, so the
plugin is the hook.

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

from collections import defaultdict
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.layers.float8 import Float8Options, precompute_float8_scales
from lightscale.plugins.precision_contract import DTYPES, FLOAT8, PRECISIONS, normalize_precision


def precision_name(plugin: Precision) -> str:
    """The precision name a Lightning plugin stands for (``32-true`` for the plain plugin)."""
    if isinstance(plugin, Float8Precision):
        return plugin.name
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
    if precision in FLOAT8 and cast_params:  # float8 matmuls inside Float8Linear, bf16 everywhere else
        compute = torch.bfloat16
    reduce = DTYPES.get(compression) or (torch.float32 if compute is not None else None)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)


# ---- clipping the whole model's gradient norm, as on one device --------------------------------------------
def total_grad_norm(parameters: Iterable[Tensor], *, pp_group: dist.ProcessGroup | None = None) -> Tensor:
    """The 2-norm of all gradients of ``parameters`` across every parallel dimension (identical on all ranks).

    A DTensor gradient's norm is reduced over the mesh axes it is sharded on (``full_tensor`` of the partial norm) and
    counted once over axes it is replicated on; gradients are grouped by (mesh, placements) because torch stacks
    per-tensor norms per group; pipeline stages hold disjoint parameters, so squared norms are summed over
    ``pp_group``.
    """
    groups: dict[object, list[Tensor]] = defaultdict(list)
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups[key].append(grad)
    squares = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares.to(norm.device) + norm.float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt()


def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, *, pp_group: dist.ProcessGroup | None = None
) -> Tensor:
    """Scale gradients in place so their global 2-norm is at most ``max_norm``; return the norm before clipping.

    Example:
        >>> total = clip_grad_norm_(model.parameters(), 1.0, pp_group=mesh["pp"].get_group())
    """
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, pp_group=pp_group)
    scale = min(1.0, max_norm / (total.item() + 1e-6))  # as torch.nn.utils.clip_grad_norm_
    if scale < 1.0:
        for param in params:
            param.grad.mul_(scale)
    return total


class _ShardedClipping:
    """Norm clipping over the full gradient: per-shard norms reduced across the mesh (DTensor), and squared norms
    summed over ``pp_group`` when pipeline stages hold disjoint parameters."""

    pp_group: dist.ProcessGroup | None = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(params, float(clip_val), pp_group=self.pp_group)


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


class Float8Precision(_ShardedClipping, MixedPrecision):
    """float8 training: bf16-mixed (by FSDP's policy, or autocast where FSDP does not cast) with the eligible Linear
    layers converted to torchao ``Float8Linear`` by the strategy's parallelize path (lightscale/layers/float8.py);
    after each optimizer step the float8 scales of FSDP-sharded weights are computed in one all-reduce.

    ``precision="float8"`` (tensorwise) or ``"float8-rowwise"`` on the Trainer makes one for CUDA; pass an instance
    with ``emulate=True`` to run torchao's emulation on CPU. ``device`` (autocast's, where FSDP does not cast)
    defaults to CUDA when there is one, else CPU.

    Example:
        >>> lightscale.Trainer(strategy="fsdp2", accelerator="cpu", plugins=[Float8Precision("float8", emulate=True)])
    """

    def __init__(self, name: str = "float8", device: str | None = None, *, emulate: bool = False) -> None:
        if name not in FLOAT8:
            raise ConfigurationError(f"Float8Precision name={name!r} is not valid; choose one of {', '.join(FLOAT8)}.")
        super().__init__("bf16-mixed", device or ("cuda" if torch.cuda.is_available() else "cpu"))  # autocast's
        self.name = name
        self.float8 = Float8Options(recipe=FLOAT8[name], emulate=emulate)  # type: ignore[arg-type]
        self.autocast = False  # parallel_3d sets it where FSDP does not cast (tp or pp without data parallelism)

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        if not self.autocast:
            yield  # FSDP casts parameters per unit
            return
        with super().forward_context():
            yield

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        precompute_float8_scales(model)
        return result


def float8_options(plugin: Precision) -> Float8Options | None:
    """The float8 conversion a strategy applies for ``plugin`` (None: no float8)."""
    return plugin.float8 if isinstance(plugin, Float8Precision) else None


class FSDP2HalfPrecision(_ShardedClipping, HalfPrecision):
    """bf16-true: the module is converted to bf16 before sharding, as under any strategy."""


class AutocastPrecision(_ShardedClipping, MixedPrecision):
    """bf16/fp16 compute by autocast (no FSDP cast: a pipeline stage, or tp without data parallelism)."""


def fsdp2_precision_plugin(precision: str, device: str, *, given: Precision | None = None) -> Precision:
    """The plugin that goes with :func:`mp_policy` for ``precision``; a ``given`` Float8Precision is kept (it
    carries the float8 options)."""
    if isinstance(given, Float8Precision):
        return given
    if precision in ("bf16-mixed", "16-mixed"):
        return FSDP2MixedPrecision(precision, device)
    if precision == "bf16-true":
        return FSDP2HalfPrecision("bf16-true")
    return FSDP2Precision()


def parallel_3d_precision_plugin(
    precision: str,
    device: str,
    *,
    fsdp_casts: bool,
    pp_group: dist.ProcessGroup | None,
    given: Precision | None = None,
) -> Precision:
    """``parallel_3d``'s plugin: FSDP's policy casts when FSDP wraps the whole module (exactly as under ``fsdp2``),
    else autocast, with one skip-or-step decision for fp16 over all ranks (found-inf summed over WORLD); clipping
    spans dp x tp x pp."""
    if isinstance(given, Float8Precision):
        plugin: Precision = given
        given.autocast = not fsdp_casts
    elif fsdp_casts or precision not in ("bf16-mixed", "16-mixed"):
        plugin = fsdp2_precision_plugin(precision, device)
    else:
        scaler = MixedTensorGradScaler(device=device) if precision == "16-mixed" else None
        plugin = AutocastPrecision(precision, device, scaler=scaler)  # type: ignore[arg-type]
    plugin.pp_group = pp_group  # type: ignore[attr-defined]
    return plugin


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
