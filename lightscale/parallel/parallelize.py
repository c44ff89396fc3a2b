"""The one way lightscale parallelizes a single-device model: float8 -> TP -> EP -> AC -> compile -> FSDP.

``fsdp2``, ``hsdp``, ``fsdp2_offload``, ``fsdp2_grad_op``, ``parallel_3d`` (each pipeline stage too) and the
``diloco`` family (inside each worker) all call
:func:`parallelize_model`, so the same degrees give the same program whichever name chose them: float8 first when
asked (it swaps Linear modules for torchao's Float8Linear; lightscale/layers/float8.py), then tensor parallelism
(it changes parameters into DTensors on the ``tp`` axis), then expert parallelism (MoE experts become
DTensors on the ``ep`` axis; lightscale/parallel/experts.py), then activation checkpointing and compile on the
units (they wrap forward, not parameters), then FSDP2 on the data-parallel axes (it shards whatever is there),
the order torchtitan uses.

Example:
    >>> options = ParallelizeOptions(activation_checkpointing="full")
    >>> parallelize_model(module, mesh, units=list(module.model.layers), options=options)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from lightscale.layers.float8 import Float8Options, apply_float8, float8_tp_plan
from lightscale.layers.moe import MoE
from lightscale.parallel.activation_checkpoint import ACMode, apply_activation_checkpointing, maybe_compile_units
from lightscale.parallel.data_parallel import broadcast_module_state
from lightscale.parallel.experts import apply_expert_parallel, expert_parameters, shard_experts_over_data
from lightscale.parallel.fsdp import apply_fsdp, contains_module, materialize_meta_module, torch_generator_states
from lightscale.parallel.fsdp_wires import ZeroPPOptions, apply_zeropp
from lightscale.parallel.mesh import axis, data_parallel_mesh, expert_data_mesh
from lightscale.parallel.tensor_parallel import TPPlan, apply_tp_plan


@dataclass
class ParallelizeOptions:
    """How to apply each step; the degrees come from the mesh."""

    activation_checkpointing: ACMode = "none"
    compile: bool = False
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    reshard_after_forward: bool | int = True  # an int: to groups of that many ranks (ZeRO++ hpZ secondary shards)
    root_reshard_after_forward: bool = False  # manual optimization (lightscale/parallel/fsdp.py apply_fsdp)
    always_shard: bool = False  # FSDP even on one data-parallel rank (the fsdp2 names: same program at any size)
    float8: Float8Options | None = None  # torchao float8 Linear layers (lightscale/layers/float8.py)
    # Which ranks FSDP spans: "data" (dp_replicate x dp_shard: HSDP), "dp_shard" only (DiLoCo: its workers meet
    # through the outer sync, not through FSDP), or "none" (a reducer of the strategy's own replicates).
    fsdp_over: Literal["data", "dp_shard", "none"] = "data"
    zeropp: ZeroPPOptions | None = None  # quantized all-gather / reduce-scatter (lightscale/parallel/fsdp_wires.py)


def parallelize_model(
    root: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Sequence[nn.Module],
    options: ParallelizeOptions,
    network: nn.Module | None = None,
    tp_plan: TPPlan | None = None,
    moe_layers: Sequence[MoE] = (),
) -> nn.Module:
    """Parallelize ``root`` in place over ``mesh`` (axes named as :meth:`ParallelDims.build_mesh` makes them).

    ``network`` is the module ``tp_plan``'s patterns are relative to (default ``root``); ``units`` are the
    repeated blocks (FSDP groups, checkpoint and compile units); ``root`` takes every parameter left over.
    ``moe_layers`` have their routed experts sharded over ``ep`` (expert parallelism) when ``ep > 1``; FSDP then
    shards those over the ranks that hold the same experts (``dp_shard``, x ``cp``), the rest over ``dp_shard x ep``
    (x ``cp``). Context parallelism changes no module: attention is routed at run time (the strategy's step).
    """
    network = network if network is not None else root
    dp_mesh = axis(mesh, "dp_shard") if options.fsdp_over == "dp_shard" else data_parallel_mesh(mesh)
    shards = options.fsdp_over != "none" and (dp_mesh.size() > 1 or options.always_shard)
    if options.float8 is not None:  # swaps Linear modules: before anything holds them
        apply_float8(network, options.float8, fsdp_all_gather=shards, tp=axis(mesh, "tp").size())
    if axis(mesh, "tp").size() > 1:
        assert tp_plan is not None, "tp > 1 needs a plan (lightscale.parallel.contract.tp_plan_of)"
        if options.float8 is not None:
            tp_plan = float8_tp_plan(tp_plan, network, options.float8, device_type=mesh.device_type)
        apply_tp_plan(network, axis(mesh, "tp"), tp_plan, strict=False)
    ignored: set[nn.Parameter] = set()
    if axis(mesh, "ep").size() > 1 and moe_layers:  # a pipeline stage may hold none
        apply_expert_parallel(moe_layers, axis(mesh, "ep"))
        ignored = expert_parameters(moe_layers)
    apply_activation_checkpointing(units, mode=options.activation_checkpointing)
    maybe_compile_units(units, enabled=options.compile)
    if options.fsdp_over == "none":
        return root
    if ignored and expert_data_mesh(mesh).size() > 1:
        shard_experts_over_data(moe_layers, mesh, mp_policy=options.mp_policy)
        ignored = set()  # FSDP-managed now: the dense groups below leave them alone
    if shards:
        apply_fsdp(
            root,
            dp_mesh,
            units=units,
            mp_policy=options.mp_policy,
            offload_policy=options.offload_policy,
            reshard_after_forward=options.reshard_after_forward,
            ignored_params=ignored,
            root_reshard_after_forward=options.root_reshard_after_forward,
        )
        if options.zeropp is not None:
            apply_zeropp(root, dp_mesh, options.zeropp)
    return root


@contextmanager
def built_on_meta() -> Iterator[dict[str, torch.Tensor]]:
    """Modules built inside land on the meta device (no rank allocates the whole model); yields the generator states
    from which ``apply_to_roots`` replays their initialization when it materializes them."""
    rng_state = torch_generator_states()
    with torch.device("meta"):
        yield rng_state


def apply_to_roots(
    module: nn.Module,
    roots: Sequence[nn.Module],
    units: Sequence[nn.Module],
    parallelize_root: Callable[[nn.Module, list[nn.Module]], None],
    *,
    device: torch.device | None = None,
    rng_state: Callable[[], dict[str, torch.Tensor] | None] | None = None,
) -> None:
    """The one way a strategy applies its parallelism to the user's ``module``: placed on ``device`` unless built on
    the meta device; every rank starts from rank 0's weights (meta tensors are skipped); each root parallelized with
    the sharding units inside it (``parallelize_root``: a strategy's call of ``parallelize_model``); a meta-built
    model materialized where its shards live, every rank replaying rank 0's generator (``rng_state``, broadcast),
    so the shards are of one model whatever each rank's seed."""
    is_meta = any(p.is_meta for p in module.parameters())
    if not is_meta and device is not None:  # built on every rank: shards must start where they will live
        module.to(device)
    broadcast_module_state(module)
    for root in roots:
        parallelize_root(root, [unit for unit in units if contains_module(root, unit)])
    if is_meta and rng_state is not None:
        assert device is not None, "a meta-built model is materialized where its shards will live"
        materialize_meta_module(module, device, rng_state=rng_state())
