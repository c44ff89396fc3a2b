"""Pieces around DeepSpeed's engine that the ZeRO strategy uses: the installed-or-not check, the module the engine
wraps, the accumulation boundary, the optimizer that steps offloaded state (CPU Adam or the user's own), and the
NVMe check.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.layers.moe import moe_layers
from lightscale.patches.deepspeed import name_cpu_accelerator
from lightscale.strategies.deepspeed.partition import is_partitioned, set_full_shape


def require_deepspeed() -> None:
    """Refuse a ZeRO strategy at construction when DeepSpeed is absent (it is an extra: a source build)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigurationError(
            "The ZeRO strategies (zero1 ... zero_infinity) run on DeepSpeed, which is not installed. Install the "
            "extra: pip install 'lightscale[deepspeed]' (DeepSpeed builds from source; docs/strategies/zero.md). "
            "Every other strategy works without it."
        )
    # lightscale runs DeepSpeed on CUDA or the CPU: without CUDA, name the CPU before DeepSpeed's first import, which
    # otherwise probes for other accelerators and warns "Setting accelerator to CPU" in every process.
    name_cpu_accelerator()


class EngineRoot(nn.Module):
    """The module DeepSpeed wraps: the LightningModule's parameters, buffers and children under the same names,
    entered once per step.

    Lightning routes ``training_step`` through ``engine(...)``, and ``training_step`` calls ``self(x)``: with the
    LightningModule as the engine's root, ZeRO-3's root hooks ran twice per step, its recorded module order never
    matched, and it fell back to gathering every parameter on its own without prefetch (2x the all-gathers, step
    time 1.3-1.7x a raw engine loop). This root shares the LightningModule's state (checkpoint keys unchanged)
    and calls its ``forward`` without ``__call__``, so only the inner ``self(x)`` enters the module tree.
    """

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self._modules = module._modules
        self._lightning_module = [module]  # in a list so it is not registered as a child

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._lightning_module[0].forward(*args, **kwargs)


@contextmanager
def not_a_boundary(engine: Any):
    engine.set_gradient_accumulation_boundary(False)
    try:
        yield
    finally:
        engine.set_gradient_accumulation_boundary(True)


@contextmanager
def scalars_as_vectors(module: nn.Module, *, stage: int) -> Iterator[None]:
    """Start a DeepSpeed engine over ``module`` whose 0-dimensional parameters (a learnable temperature) keep that
    shape for the user.

    DeepSpeed sends each parameter as bytes while it starts (``p.data.view(torch.uint8)``: the engine's broadcast of
    rank 0's weights, and ZeRO-3's partitioning), which a 0-dimensional tensor refuses. Every rank first takes rank
    0's value of each such parameter (a plain broadcast). Then:
        * ZeRO-3: while the engine starts they are viewed as shape ``[1]`` (same storage, one element), so DeepSpeed
          partitions them like any other; after, their full shape ``ds_shape`` (what each gather restores,
          lightscale/strategies/deepspeed/partition.py) is set back to ``[]``.
        * ZeRO-0/1/2: the engine's broadcast skips parameters marked ``ds_optim_param`` (its OptimizedLinear's own
          shards; the mark means nothing else unless OptimizedLinear offload is configured), so they carry it only
          while the engine starts. Their shape never changes: the gradient hooks ZeRO-1/2 register record it.
    The engine otherwise only counts elements (one, either way); forward, ``state_dict`` and every checkpoint see
    the user's shape.
    """
    scalars = [p for p in module.parameters() if p.ndim == 0]
    if dist.is_initialized():
        for param in scalars:
            dist.broadcast(param.data, src=0)
    for param in scalars:
        if stage == 3:
            param.data = param.data.view(1)
        else:
            param.ds_optim_param = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for param in scalars:
            if is_partitioned(param):
                set_full_shape(param, torch.Size([]))
            if param.data.shape == (1,):  # a gathered (persistent) ZeRO-3 parameter
                param.data = param.data.view(())
            if hasattr(param, "ds_optim_param"):
                del param.ds_optim_param


@contextmanager
def explain_partitioned_shapes(module: nn.Module):
    """Name the cause when ``configure_optimizers`` fails on ZeRO-3 parameters built in ``configure_model``:
    ``deepspeed.zero.Init`` partitions them as they are built, so each shows shape (0,) while the user's code runs
    (torch's Muon refuses anything but 2-D parameters when it is built; selecting matrices by ``p.ndim`` finds none)."""
    try:
        yield
    except (ValueError, RuntimeError) as error:
        if not any(is_partitioned(p) and p.numel() == 0 for p in module.parameters()):
            raise
        raise ConfigurationError(
            f"configure_optimizers failed under ZeRO-3 ({type(error).__name__}: {error}). Parameters built in "
            "configure_model are partitioned as they are built (deepspeed.zero.Init), so while configure_optimizers "
            "runs each has shape (0,): an optimizer that checks shapes when it is built (torch.optim.Muon takes 2-D "
            "parameters only) or code that picks parameters by p.ndim sees no matrices. Build those layers in "
            "__init__ (ZeRO-3 then partitions them when its engine starts), or use zero1 / zero2 (Muon runs there) "
            "or fsdp2."
        ) from error


def check_zero_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what DeepSpeed would silently change: it rebuilds Adagrad over its flat partitions as one group."""
    if isinstance(optimizer, torch.optim.Adagrad) and len(optimizer.param_groups) > 1:
        raise ConfigurationError(
            f"Adagrad with {len(optimizer.param_groups)} parameter groups under ZeRO: DeepSpeed rebuilds Adagrad with "
            "one group and the defaults, dropping each group's settings. Use one group, or fsdp2 / bucketed_ddp."
        )


def host_optimizer(optimizer: torch.optim.Optimizer, user_config: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer that steps the offloaded fp32 partitions, with one info line (rank 0) saying which it is.

    Adam/AdamW step as DeepSpeed's CPU Adam, unless the config says ``zero_force_ds_cpu_optimizer: False``; any other
    torch optimizer steps as itself, torch's own implementation on the host (DeepSpeed allows it when that key is
    False, which build_config then writes).
    """
    name = type(optimizer).__name__
    adam = type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
    if adam and user_config.get("zero_force_ds_cpu_optimizer") is not False:
        rank_zero_info(f"lightscale: optimizer offload steps {name} as DeepSpeed's CPU Adam on the host.")
        return cpu_adam_from(optimizer)
    rank_zero_info(f"lightscale: optimizer offload steps {name} with torch's own implementation on the host.")
    return optimizer


def cpu_adam_from(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam with ``optimizer``'s parameter groups and hyper-parameters (Adam or AdamW only)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(f"cpu_adam_from takes Adam or AdamW, got {type(optimizer).__name__}.")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        groups = [dict(group) for group in optimizer.param_groups]
        defaults = optimizer.defaults
        return DeepSpeedCPUAdam(
            groups,
            lr=defaults["lr"],
            betas=defaults["betas"],
            eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            adamw_mode=isinstance(optimizer, torch.optim.AdamW),
        )
    except (ImportError, RuntimeError, OSError) as error:
        raise RuntimeError(
            "DeepSpeed's CPU Adam extension could not be built. It JIT-compiles with g++ and ninja against the "
            "Python headers: install a C++ compiler (apt-get install g++), `pip install ninja`, and python3-dev. "
            f"Cause: {error}"
        ) from error


def check_async_io() -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ConfigurationError(
            "NVMe offload (zero_infinity) needs DeepSpeed's async_io op, which builds against libaio: install it "
            "(Debian/Ubuntu: apt-get install libaio-dev) or use zero3_offload (host memory) instead."
        )


# DeepSpeed calls collectives torch has deprecated, once per parameter fetch: hundreds of identical lines that
# drown the user's own warnings. Matched by message and by torch's warning site, so nothing else is hidden.
_DEEPSPEED_NOISE = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def silence_deepspeed_noise() -> None:
    """Ignore the deprecation warnings torch raises for DeepSpeed's collectives (idempotent)."""
    warnings.filterwarnings("ignore", _DEEPSPEED_NOISE, FutureWarning, r"torch\.distributed\.c10d_logger")


def refuse_moe(module: LightningModule) -> None:
    """MoE layers are refused: DeepSpeed would partition the stacked expert weights as dense parameters (ZeRO-3
    gathers every expert of a layer on every rank), with no expert dimension to shard them over."""
    if moe_layers(module):
        raise ConfigurationError(
            "The ZeRO strategies do not train mixture-of-experts models: DeepSpeed partitions the stacked expert "
            "weights like dense ones (ZeRO-3 would gather every expert of a layer on every rank) and has no expert "
            "parallelism here; DeepSpeed's own MoE refuses stage 3. Use 'ep2' or Parallel3DStrategy(ep=N) (experts "
            "sharded over ranks, tokens sent by all-to-all, the rest FSDP2), or 'fsdp2' / 'parallel_3d' (experts "
            "sharded by FSDP2 like any weight)."
        )
