"""The model contract: what a LightningModule may tell lightscale's strategies, all in one place.

Every hook is optional. A LightningModule that defines none trains under every data-parallel name (DDP, ZeRO,
FSDP2, ``parallel_3d`` with only ``dp``): its network is the module itself (or its ``model`` child) and FSDP's
units are inferred (:func:`~lightscale.parallel.fsdp.infer_units`). Tensor and pipeline parallelism need a plan,
so ``tp > 1`` asks for :meth:`ParallelModel.tp_plan` and ``pp > 1`` for :meth:`ParallelModel.pipeline_stages`
and :meth:`ParallelModel.loss_fn`; a missing hook is a :class:`ConfigurationError` naming it, before any work.
Context parallelism (``cp > 1``) needs no hook for ``(tokens, targets)`` batches of ``(batch, seq)`` tensors; other
batches say where their sequence dimension is through :meth:`ParallelModel.sequence_dims`. The model itself reads
its tokens' global positions from :func:`lightscale.parallel.context_parallel.positions` (``arange`` on one device).

Example (a model opting into TP and pipelines; the GPT recipe's ``GPTModule`` is the full version)::

    class MyModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = MyNet()  # single-device: embed, blocks (ModuleList), head

        def sharding_units(self):
            return list(self.model.blocks)

        def tp_plan(self, *, sequence_parallel, loss_parallel):
            return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

        def pipeline_stages(self, num_stages):
            return even_stage_split([f"blocks.{i}" for i in range(8)], num_stages, first=["embed"], last=["head"])

        def loss_fn(self, output, target):
            return F.cross_entropy(output.flatten(0, 1), target.flatten())

        def loss(self, batch):  # training_step computes its loss through self.loss: a pipeline serves it
            x, y = batch
            return self.loss_fn(self(x), y)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from lightscale.errors import ConfigurationError
from lightscale.parallel.fsdp import describe_units, find_units, infer_units
from lightscale.parallel.tensor_parallel import TPPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransformerShape:
    """What the activation formula needs to know about a decoder-only transformer (declared by the recipe)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int | None = None  # default 4 x hidden
    kv_heads: int | None = None  # grouped-query attention; default: heads
    dropout: bool = False
    flash_attention: bool = True  # fused attention keeps no s x s matrices

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


@runtime_checkable
class ParallelModel(Protocol):
    """The hooks a LightningModule may define for lightscale's strategies (all optional)."""

    def sharding_units(self) -> Sequence[nn.Module]:
        """The repeated blocks: one FSDP group, one activation-checkpoint and one compile unit each."""
        ...

    def tp_plan(self, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
        """Module-name pattern (relative to the network) -> ``ParallelStyle``; needed for ``tp > 1``."""
        ...

    def pipeline_stages(self, num_stages: int) -> list[list[str]]:
        """Module names of the network held by each stage; needed for ``pp > 1``."""
        ...

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss of one microbatch, computed on the last pipeline stage; needed for ``pp > 1``."""
        ...

    def validate_parallelism(self, *, tp: int, num_stages: int, sequence_parallel: bool, loss_parallel: bool) -> None:
        """Raise ConfigurationError if the model cannot be split this way (called before any model work)."""
        ...

    def sequence_dims(self, batch: Any) -> Any:
        """Under context parallelism: each tensor's sequence dimension in ``batch``, as a structure like it (a tuple
        for a tuple, a dict for a dict; ``None`` keeps a tensor whole on every cp rank). Labels must be next-token
        targets already (shifted before sharding). Default: ``(batch, seq)`` tensors, sequence dimension 1."""
        ...

    def transformer_shape(self) -> TransformerShape:
        """Layers, widths, heads, sequence and vocabulary of a decoder-only transformer: ``lightscale estimate``
        then predicts activations by the Megatron formula instead of a one-sample forward."""
        ...


PIPELINE_HOOKS = ("pipeline_stages", "loss_fn", "loss")


def has_hook(module: object, name: str) -> bool:
    return callable(getattr(module, name, None))


def network_of(module: nn.Module) -> nn.Module:
    """The network the plans name modules in: the module's ``model`` child if it has one, else the module."""
    model = getattr(module, "model", None)
    return model if isinstance(model, nn.Module) else module


def data_parallel_root(module: nn.Module) -> nn.Module:
    """The module FSDP roots at: the network child when every parameter lives in it (the step enters it once,
    through the user's own call), else the LightningModule itself, whose steps must then enter it through
    ``__call__`` (Lightning's forward redirection)."""
    network = network_of(module)
    if network is module:
        return module
    inside = {id(p) for p in network.parameters()}
    return network if all(id(p) in inside for p in module.parameters()) else module


def manual_optimization(module: nn.Module) -> bool:
    return not getattr(module, "automatic_optimization", True)


def data_parallel_roots(module: nn.Module, *, strategy: str) -> list[nn.Module]:
    """The modules FSDP roots at: ``[data_parallel_root(module)]``, except under manual optimization when that is
    the LightningModule itself. Its step would then run inside the root's forward, where ``manual_backward`` leaves
    gradients on the gathered parameters: FSDP reduces them onto the shards the optimizers step only in a
    post-backward its root queues from the root forward's outputs (none: the step returns no loss), so the
    optimizers would step shards without gradients. Instead each child holding parameters is a root of its own,
    whose forward the step calls and whose outputs' backward reduces the gradients (the step runs outside any)."""
    root = data_parallel_root(module)
    if root is not module or not manual_optimization(module):
        return [root]
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ConfigurationError(
            f"{strategy} with manual optimization (automatic_optimization=False) shards each child network of "
            f"{type(module).__name__} as its own FSDP root, but {own} belong to the LightningModule itself, outside "
            "every child: no forward would gather them. Move them into a child module (e.g. an nn.Module attribute "
            "the step calls), or use BucketedDDPStrategy(find_unused_parameters=True)."
        )
    roots = [child for child in module.children() if any(True for _ in child.parameters())]
    _check_no_shared_parameters(module, roots, strategy)
    return roots


def _check_no_shared_parameters(module: nn.Module, roots: list[nn.Module], strategy: str) -> None:
    """One parameter in two children would be sharded twice, by two roots that reduce its gradient apart."""
    owner: dict[int, str] = {}
    names = {id(child): name for name, child in module.named_children()}
    for root in roots:
        for parameter in root.parameters():
            first = owner.setdefault(id(parameter), names[id(root)])
            if first != names[id(root)]:
                raise ConfigurationError(
                    f"{strategy} with manual optimization (automatic_optimization=False) shards each child network "
                    f"of {type(module).__name__} as its own FSDP root, but children {first!r} and {names[id(root)]!r} "
                    "share a parameter (tied weights). Put the tied modules under one child, or use "
                    "BucketedDDPStrategy(find_unused_parameters=True)."
                )


def sharding_units(module: nn.Module, *, unit_classes: Sequence[str] | None = None) -> list[nn.Module]:
    """The strategy's ``unit_classes`` if given, else the module's ``sharding_units()``, else inferred."""
    network = network_of(module)
    if unit_classes:
        return find_units(network, unit_classes)
    if has_hook(module, "sharding_units"):
        return list(module.sharding_units())  # type: ignore[attr-defined]
    units = infer_units(network)
    log.info("lightscale: %s defines no sharding_units(); inferred %s", type(module).__name__, describe_units(units))
    return units


def tp_plan_of(module: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> TPPlan:
    if not has_hook(module, "tp_plan"):
        raise ConfigurationError(
            f"Tensor parallelism (tp > 1) needs a plan: define {type(module).__name__}.tp_plan(self, *, "
            "sequence_parallel, loss_parallel) returning {module-name pattern: ColwiseParallel() | RowwiseParallel() "
            "| ...} (see lightscale/parallel/contract.py and the GPT recipe's gpt_tp_plan), or use tp=1."
        )
    return module.tp_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)  # type: ignore[attr-defined]


def check_hooks(module: nn.Module, *, tp: int, pp: int) -> None:
    """Raise before any work if the parallel degrees need hooks ``module`` does not define."""
    if tp > 1:
        tp_plan_of(module, sequence_parallel=False, loss_parallel=False)
    missing = [hook for hook in PIPELINE_HOOKS if not has_hook(module, hook)] if pp > 1 else []
    if missing:
        raise ConfigurationError(
            f"Pipeline parallelism (pp > 1) needs the hooks {missing} on {type(module).__name__}: pipeline_stages("
            "num_stages) -> module names per stage, loss_fn(output, target) -> microbatch loss, and a loss(batch) "
            "method that training_step uses (the pipeline serves it). See lightscale/parallel/contract.py, or use pp=1."
        )


def sequence_dims_of(module: nn.Module, batch: Any, *, name: str | None = None) -> Any:
    """Where ``batch``'s tensors have their sequence dimension (context parallelism shards it): the module's
    ``sequence_dims(batch)``, else dimension 1 of every tensor of a batch of ``(batch, seq)`` tensors (a tensor, a
    tuple/list or a dict of them, e.g. ``(tokens, targets)``); anything else is refused, naming the hook on the
    module's class ``name`` (default: its class name now)."""
    if has_hook(module, "sequence_dims"):
        return module.sequence_dims(batch)  # type: ignore[attr-defined]
    tensors = list(batch.values()) if isinstance(batch, Mapping) else batch
    tensors = [tensors] if isinstance(tensors, Tensor) else tensors
    plain = isinstance(tensors, (list, tuple)) and bool(tensors)
    if plain and all(isinstance(t, Tensor) and t.dim() == 2 for t in tensors) and len({t.shape for t in tensors}) == 1:
        if isinstance(batch, Tensor):
            return 1
        return {key: 1 for key in batch} if isinstance(batch, Mapping) else type(batch)([1] * len(batch))
    name = name or type(module).__name__
    raise ConfigurationError(
        f"Context parallelism (cp > 1) shards each batch along its sequence dimension, and {name}'s batch is not a "
        f"(tokens, targets)-like batch of equal (batch, seq) tensors: got {_describe(batch)}. Define "
        f"{name}.sequence_dims(self, batch) returning each tensor's sequence dimension (None keeps it whole), as a "
        "structure like the batch (see lightscale/parallel/contract.py), or use cp=1."
    )


def _describe(batch: Any) -> str:
    if isinstance(batch, Tensor):
        return f"a tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{key!r}: {_describe(value)}" for key, value in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__}(" + ", ".join(_describe(value) for value in batch) + ")"
    return type(batch).__name__
