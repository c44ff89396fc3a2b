"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied to a single-device model from outside.

Each sharding unit (a transformer block, chosen by class name or given as modules) becomes its own FSDP
parameter group, then the root takes whatever is left: one all-gather and one reduce-scatter per unit. The
mesh decides the flavour: 1-D shards across all of it (FSDP), 2-D replicates across dim 0 and shards within
dim 1 (HSDP).

A model built on the meta device is materialized shard by shard (:func:`materialize_meta_module`): every
rank re-draws one module's full tensors at a time with the same generator, in construction order, and keeps
its own slice, so the values equal single-device init with the same seed and no rank ever holds the model.

0-dimensional parameters (a learnable temperature) cannot be cut along dimension 0: they stay whole on every rank,
outside FSDP, and their gradients are averaged over the mesh (:class:`ScalarGradients`).

Example:
    >>> mesh = init_device_mesh("cpu", (2,))
    >>> apply_fsdp(model, mesh, unit_classes=("TransformerBlock",))
    >>> materialize_meta_module(model, torch.device("cpu"))
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from lightscale.errors import ConfigurationError
from lightscale.parallel.ties import retie, tied_parameters


def module_class_names(model: nn.Module) -> list[str]:
    """Sorted class names of every submodule of ``model`` (the valid unit class names)."""
    return sorted({type(module).__name__ for module in model.modules()})


def check_unit_classes(model: nn.Module, names: Sequence[str]) -> None:
    """Raise a ConfigurationError naming the valid class names if any of ``names`` is not in ``model``."""
    valid = module_class_names(model)
    for name in names:
        if name not in valid:
            closest = difflib.get_close_matches(name, valid, n=1)
            hint = f" Did you mean {closest[0]!r}?" if closest else ""
            raise ConfigurationError(
                f"FSDP unit class {name!r} does not occur in {type(model).__name__}.{hint} "
                f"Class names in the model: {', '.join(valid)}."
            )


def find_units(model: nn.Module, unit_classes: Sequence[str]) -> list[nn.Module]:
    """Submodules of ``model`` whose class name is in ``unit_classes``, outermost first, never nested twice."""
    check_unit_classes(model, unit_classes)
    units: list[nn.Module] = []
    for module in model.modules():
        wanted = module is not model and type(module).__name__ in unit_classes
        if wanted and not any(contains_module(unit, module) for unit in units):
            units.append(module)
    return units


def contains_module(outer: nn.Module, inner: nn.Module) -> bool:
    return any(module is inner for module in outer.modules())


def infer_units(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model that names none: the children of its largest ``nn.ModuleList`` or
    ``nn.Sequential`` whose children all share one class (largest by parameter count); else no unit (the whole
    model is then one FSDP group)."""
    best: list[nn.Module] = []
    best_size = 0
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or len(container) < 2:
            continue
        children = list(container.children())
        if len({type(child) for child in children}) != 1:
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:
            best, best_size = children, size
    return best


def describe_units(units: Sequence[nn.Module]) -> str:
    if not units:
        return "no repeated blocks found: the whole model is one FSDP unit"
    return f"{len(units)} x {type(units[0]).__name__}"


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    unit_classes: Sequence[str] = (),
    units: Iterable[nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int = True,
    ignored_params: set[nn.Parameter] | None = None,
    root_reshard_after_forward: bool = False,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: each unit its own group, the root last.

    ``units`` (modules) wins over ``unit_classes`` (class names, so YAML can express them). The root keeps its
    parameters unsharded after forward (backward needs them first), as FSDP recommends, unless
    ``root_reshard_after_forward``: under manual optimization an optimizer may step the shards between a forward
    with no backward (which leaves them gathered) and the next forward, which would reuse the stale gathered copy.
    """
    chosen = list(units) if units is not None else find_units(model, unit_classes)
    common = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    common["offload_policy"] = offload_policy or OffloadPolicy()
    # Expert-parallel experts are sharded over other ranks than the dense part; 0-dimensional parameters cannot be
    # sharded: kept whole on every rank, their gradients averaged over the mesh (ScalarGradients, below).
    scalars = scalar_parameters(model)
    if ignored_params or scalars:
        common["ignored_params"] = set(ignored_params or ()) | scalars
    for unit in reversed(chosen):  # bottom-up; order does not change grouping, only hook registration
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **common)
    fully_shard(model, reshard_after_forward=root_reshard_after_forward, **common)
    if scalars:
        ScalarGradients(model, mesh)
    return model


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def reset_interrupted_roots(roots: Sequence[nn.Module]) -> None:
    """After an exception inside a step: every FSDP2 root back to its sharded parameters and an idle state, as torch's
    ``reset_iter_state`` does (torch >= 2.13; older torch: ``reshard``, which leaves a root that raised mid-forward
    unsharded). A step that raised inside a root's forward left its parameters unsharded, and Lightning's teardown
    (``module.cpu()``) would then raise over the user's error, which the script may be catching."""
    for root in roots:
        # A root that never ran forward (refused before the first step) has no iteration state to reset.
        if not isinstance(root, FSDPModule) or root._get_fsdp_state()._is_root is None:
            continue
        reset = getattr(root, "reset_iter_state", None)
        if reset is not None:
            reset()
        else:
            for unit in fsdp_modules(root):
                unit.reshard()


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP's gradient reduce-scatter (and HSDP all-reduce) on or off for every unit of ``model``, and the
    all-reduce of its 0-dimensional parameters' gradients."""
    for module in fsdp_modules(model):
        module.set_requires_gradient_sync(enabled, recurse=False)
    set_scalar_sync(model, enabled)


@contextmanager
def no_gradient_sync(model: nn.Module | None) -> Iterator[None]:
    """FSDP's reduce-scatter off for the backward passes inside (a gradient-accumulation micro-step)."""
    if model is not None:
        set_gradient_sync(model, False)
    try:
        yield
    finally:
        if model is not None:
            set_gradient_sync(model, True)


# ---- 0-dimensional parameters, kept whole beside the shards -------------------------------------------------
_REDUCERS: weakref.WeakKeyDictionary[nn.Module, ScalarGradients] = weakref.WeakKeyDictionary()


def scalar_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The 0-dimensional (not DTensor) parameters of ``module``: those FSDP2 cannot shard."""
    return {p for p in module.parameters() if p.ndim == 0 and not isinstance(p, DTensor)}


class ScalarGradients:
    """Average the gradients of ``root``'s 0-dimensional parameters over ``mesh`` (every dimension) after backward.

    ``fully_shard`` cuts each parameter along dimension 0 and refuses 0-dimensional ones ("doesn't support scalar
    parameters"). A learnable temperature (``nn.Parameter(torch.tensor(1.0))``, OpenCLIP's ``logit_scale``) is common
    in models users cannot edit, and sharding one element buys nothing. So :func:`apply_fsdp` leaves them out of FSDP
    (``ignored_params``) and this does for them what DDP does: after each backward that syncs gradients, it averages
    their gradients over the data-parallel mesh, the mean FSDP's reduce-scatter takes of the sharded ones. All ranks
    start from the same value (the strategies broadcast rank 0's weights), all-reduce gives every rank the same bits,
    and the optimizer steps the same numbers on each, so the replicas never drift. The user's module keeps its own
    tensor, shape ``[]``: forward, ``state_dict`` and every checkpoint see the shape the user wrote, and a checkpoint
    writer stores the whole tensor once (DCP deduplicates replicated plain tensors).

    The gradient hooks are (re)attached before each forward of ``root``, to whichever tensors its 0-dimensional
    parameters are then: materializing a meta-device model replaces plain parameters with new tensors.
    :func:`set_scalar_sync` turns the all-reduce off inside a gradient-accumulation micro-step, as FSDP's
    ``set_requires_gradient_sync`` does for the shards; the step that syncs then averages the accumulated sum.

    Example:
        >>> scalars = scalar_parameters(model)  # {model.logit_scale}
        >>> fully_shard(model, mesh=mesh, ignored_params=scalars)
        >>> ScalarGradients(model, mesh)  # averages model.logit_scale.grad over mesh after each backward
    """

    def __init__(self, root: nn.Module, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.enabled = True
        self._hooked: weakref.WeakSet[nn.Parameter] = weakref.WeakSet()
        root.register_forward_pre_hook(self._attach)
        self._attach(root, ())
        _REDUCERS[root] = self

    def _attach(self, module: nn.Module, args: Any) -> None:
        for param in scalar_parameters(module):
            if param.requires_grad and param not in self._hooked:
                param.register_post_accumulate_grad_hook(self._reduce)
                self._hooked.add(param)

    def _reduce(self, param: torch.Tensor) -> None:
        if not self.enabled or param.grad is None:
            return
        wire = param.grad.to(self.mesh.device_type)  # an offloaded (host) scalar crosses an accelerator's group there
        for dim in range(self.mesh.ndim):  # sum over each axis in turn = sum over the whole mesh (HSDP: 2-D)
            dist.all_reduce(wire, group=self.mesh.get_group(dim))
        wire.div_(self.mesh.size())
        if wire is not param.grad:
            param.grad.copy_(wire)


def set_scalar_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the gradient all-reduce of every :class:`ScalarGradients` inside ``model`` on or off."""
    for module in model.modules():
        reducer = _REDUCERS.get(module)
        if reducer is not None:
            reducer.enabled = enabled


# ---- materialization from the meta device ----------------------------------------------------------------
def torch_generator_states() -> dict[str, torch.Tensor]:
    """The CPU (and, if present, current CUDA) generator states, to replay initialization later."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_torch_generator_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


def materialize_meta_module(
    model: nn.Module, device: torch.device, *, rng_state: dict[str, torch.Tensor] | None = None
) -> None:
    """Allocate only the local shards of a meta-device ``model`` on ``device`` and initialize them exactly as
    single-device construction with the same seed would.

    Every module with ``reset_parameters`` (in ``modules()`` order = construction order) draws its own
    parameters into full-size temporaries on every rank, with the same RNG; each rank keeps its slice. A
    parameter shared with an earlier module (tied weights) keeps the earlier draw, as the constructor does.
    ``rng_state`` (from :func:`torch_generator_states`) is taken just before the model was built on the meta device.
    """
    _check_materializable(model)
    kept = _real_tensors(model)  # built outside the meta context (e.g. in __init__): keep their values
    ties = tied_parameters(model)
    model.to_empty(device=device)  # a plain (not DTensor) parameter becomes a new tensor under each of its names
    retie(model, ties)
    done = _restore(model, kept)
    for module in model.modules():  # buffers whose module can re-create them (e.g. MoE router biases)
        if callable(getattr(module, "reset_buffers", None)):
            module.reset_buffers()
    if rng_state is not None:
        _set_torch_generator_states(rng_state)
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        already = own and all(id(p) in done for p in own)  # built for real: its draws preceded the snapshot
        if callable(getattr(module, "reset_parameters", None)) and not already:
            _reset_module_shards(module, device, done)
    missed = [name for name, p in model.named_parameters() if id(p) not in done]
    if missed:
        raise ConfigurationError(
            f"Parameters {missed} belong to modules without reset_parameters(), so they cannot be initialized "
            "after building on the meta device. Give their modules a reset_parameters(), or set meta_init=False."
        )


def _real_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = {f"p.{name}": p for name, p in model.named_parameters()}
    tensors |= {f"b.{name}": b for name, b in model.named_buffers()}
    return {name: _local(t).detach().clone() for name, t in tensors.items() if not _local(t).is_meta}


def _restore(model: nn.Module, kept: dict[str, torch.Tensor]) -> set[int]:
    """Copy ``kept`` values back after ``to_empty``; return the ids of the parameters restored."""
    done: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"p.{name}" in kept:
                _local(p).copy_(kept[f"p.{name}"])
                done.add(id(p))
        for name, b in model.named_buffers():
            if f"b.{name}" in kept:
                _local(b).copy_(kept[f"b.{name}"])
    return done


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _check_materializable(model: nn.Module) -> None:
    resettable = {id(b) for m in model.modules() if callable(getattr(m, "reset_buffers", None)) for b in m.buffers()}
    buffers = [name for name, b in model.named_buffers() if b.is_meta and id(b) not in resettable]
    if buffers:
        raise ConfigurationError(
            f"Buffers {buffers} were built on the meta device and their values cannot be recovered; "
            "set meta_init=False for this model (it is then built on every rank and sharded after)."
        )


def _reset_module_shards(module: nn.Module, device: torch.device, done: set[int]) -> None:
    originals = dict(module.named_parameters(recurse=False))
    full = {name: torch.empty(_full_shape(p), dtype=p.dtype, device=device) for name, p in originals.items()}
    for name, tensor in full.items():
        module.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    try:
        with torch.no_grad():
            module.reset_parameters()
    finally:
        for name, param in originals.items():
            module.register_parameter(name, param)
    for name, param in originals.items():
        if id(param) not in done:
            _copy_local_slice(param, full[name])
            done.add(id(param))


def _full_shape(param: torch.Tensor) -> torch.Size:
    return param.shape  # a DTensor reports its global shape


@torch.no_grad()
def _copy_local_slice(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        # src_data_rank=None: each rank slices its own copy (all ranks drew the same values), no communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
