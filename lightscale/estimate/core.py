"""``estimate_memory``: per-rank bytes of parameters, gradients, optimizer state and activations, before any run.

The model is built on the meta device (no memory, any size); the strategy's :class:`Layout` says how states are
split and where they live; activations come from the transformer formula when the module declares its shape
(``transformer_shape()``, see lightscale/parallel/contract.py), else from a one-sample forward on meta tensors,
scaled to the micro-batch.

Example:
    >>> est = estimate_memory(GPTModule(config), "zero3", world_size=1024, precision="bf16-mixed", micro_batch=4)
    >>> est.device_total / 2**30
    3.1
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightscale.estimate.activations import (
    TransformerShape,
    measure_activation_bytes,
    pipeline_in_flight,
    transformer_activation_bytes,
)
from lightscale.estimate.memory_layout import Layout, layout_of
from lightscale.estimate.model_states import (
    PerParameter,
    Placed,
    bytes_per_parameter,
    model_states,
    secondary_shard_bytes,
)
from lightscale.estimate.optimizer_state import adafactor_state_bytes, is_factored, states_per_element
from lightscale.estimate.parameters import Numel, own_numel, rank_parameter_split, whole_gradient_elements
from lightscale.parallel.activation_checkpoint import apply_activation_checkpointing
from lightscale.parallel.contract import has_hook, sharding_units

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
FORMULA = "transformer formula (Megatron terms)"
MEASURED = "measured: one-sample forward on the meta device, scaled"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank (the most loaded one) holds, by category, on the device and on the host."""

    strategy: str
    world_size: int
    precision: str
    micro_batch: int
    num_params: int
    rank_params: int
    parameters: Placed
    gradients: Placed
    optimizer: Placed
    activations: Placed
    activation_source: str
    activation_checkpointing: str = "none"

    @property
    def device_total(self) -> float:
        return sum(getattr(self, c).device for c in CATEGORIES)

    @property
    def host_total(self) -> float:
        return sum(getattr(self, c).host for c in CATEGORIES)

    @property
    def model_states(self) -> float:
        return sum(getattr(self, c).total for c in CATEGORIES[:3])

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device_total": self.device_total, "host_total": self.host_total}


def estimate_memory(
    module: nn.Module,
    strategy: str | Strategy | Layout,
    *,
    world_size: int,
    precision: str = "32-true",
    micro_batch: int = 1,
    seq_len: int | None = None,
    batch: Any = None,
    activation_checkpointing: str | None = None,
    optimizer_states: int = 2,
    optimizer: type[torch.optim.Optimizer] | None = None,
    activations: bool = True,
    numel: Numel = own_numel,
) -> MemoryEstimate:
    """Estimate one rank's memory for ``module`` trained under ``strategy`` on ``world_size`` ranks.

    ``module`` may be unbuilt: ``configure_model()`` runs on the meta device. ``batch`` is one example batch (only
    needed when the module declares no ``transformer_shape()``). ``activation_checkpointing`` overrides the
    strategy's mode; ``optimizer_states`` is 2 for Adam; ``optimizer`` (a class) overrides it: Adam/AdamW 2, SGD and
    Muon 1, Adafactor its factored state (lightscale/estimate/optimizer_state.py); ``activations=False`` skips them
    (model states only). ``numel`` gives a parameter's global size: for a live model, the running strategy's
    ``global_numel``.
    """
    layout = strategy if isinstance(strategy, Layout) else layout_of(strategy, world_size=world_size)
    if activation_checkpointing is not None:
        layout = layout.with_(activation_checkpointing=activation_checkpointing)
    build_on_meta(module)
    dense, experts = rank_parameter_split(module, layout, numel=numel)
    if optimizer is not None:
        optimizer_states = 0 if is_factored(optimizer) else states_per_element(optimizer, optimizer_states)
    per = bytes_per_parameter(precision, engine=layout.engine, optimizer_states=optimizer_states)
    extra = whole_gradient_elements(module, layout)
    states = model_states(dense, layout, per, extra_gradient_elements=extra, expert_sizes=experts)
    if is_factored(optimizer):
        states = replace(states, optimizer=_plus(states.optimizer, _factored_bytes(module, layout, per), layout))
    secondary = secondary_shard_bytes(_unit_shapes(module) if layout.secondary_shard > 1 else [], layout, precision)
    saved, source = 0.0, "not estimated"
    if activations:
        saved, source = _activations(module, layout, precision, micro_batch, seq_len, batch)
    return MemoryEstimate(
        strategy=layout.name,
        world_size=layout.world_size,
        precision=precision,
        micro_batch=micro_batch,
        num_params=sum(numel(p) for p in module.parameters()),
        rank_params=sum(dense) + sum(experts),
        parameters=Placed(states.parameters.device + secondary, states.parameters.host),
        gradients=states.gradients,
        optimizer=states.optimizer,
        activations=Placed(device=saved),
        activation_source=source,
        activation_checkpointing=layout.activation_checkpointing,
    )


def _factored_bytes(module: nn.Module, layout: Layout, per: PerParameter) -> int:
    """Adafactor's factored state per rank: whole parameters, or FSDP2's dimension-0 shards (ShardedAdafactor)."""
    if layout.engine == "deepspeed" or layout.tp > 1 or layout.pp > 1 or layout.ep > 1:
        raise ValueError(
            f"Adafactor's factored state is estimated for bucketed_ddp and the FSDP2 family (tp = pp = ep = 1), not "
            f"{layout.name!r}: ZeRO refuses Adafactor (lightscale/optim/rule.py); tensor, pipeline and expert splits "
            "are not modelled for it."
        )
    shapes = [p.shape for p in module.parameters()]  # each tensor once (tied weights too)
    dp_shard = layout.dp_shard if layout.shard_optimizer else 1
    return adafactor_state_bytes(shapes, dp_shard=dp_shard, dtype_bytes=per.parameters)


def _plus(placed: Placed, nbytes: int, layout: Layout) -> Placed:
    if layout.offload_optimizer:
        return Placed(placed.device, placed.host + nbytes)
    return Placed(placed.device + nbytes, placed.host)


def _unit_shapes(module: nn.Module) -> list[torch.Size]:
    """Shapes of the parameters of the sharding units (hpZ keeps these over the secondary group)."""
    return [p.shape for unit in sharding_units(module) for p in unit.parameters()]


def build_on_meta(module: nn.Module) -> None:
    """Run ``configure_model()`` on the meta device if the module builds its network there (idempotent)."""
    if has_hook(module, "configure_model"):
        with torch.device("meta"):
            module.configure_model()  # type: ignore[operator]


def _activations(
    module: nn.Module, layout: Layout, precision: str, micro_batch: int, seq_len: int | None, batch: Any
) -> tuple[float, str]:
    if has_hook(module, "transformer_shape"):
        shape: TransformerShape = module.transformer_shape()  # type: ignore[attr-defined]
        if seq_len is not None:
            shape = TransformerShape(**{**asdict(shape), "seq_len": seq_len})
        return _formula(shape, layout, precision, micro_batch), FORMULA
    if batch is None:
        raise ValueError(
            f"{type(module).__name__} declares no transformer_shape(): pass one example batch to measure activations."
        )
    return _measured(module, layout, batch) * micro_batch, MEASURED


def _formula(shape: TransformerShape, layout: Layout, precision: str, micro_batch: int) -> float:
    if layout.pp == 1:
        parts = transformer_activation_bytes(shape, micro_batch=micro_batch, precision=precision, layout=layout)
        return parts["layers"] + parts["head"]
    per_rank = shape.layers // layout.pp
    mb = max(1, micro_batch // layout.microbatches)
    parts = transformer_activation_bytes(shape, micro_batch=mb, precision=precision, layout=layout, layers=per_rank)
    first = parts["layers"] * pipeline_in_flight(layout)  # the first stage holds the most micro-batches
    last = parts["layers"] + parts["head"]
    return max(first, last)


def _measured(module: nn.Module, layout: Layout, batch: Any) -> float:
    """Saved bytes of one sample's forward and loss (tensor/pipeline splits not modeled).

    A model built on the meta device runs as CPU fake tensors: shapes and kernels (fused attention) as on a real
    CPU, no memory. Real tensors run as they are.
    """
    module.train()
    if layout.activation_checkpointing != "none":
        apply_activation_checkpointing(sharding_units(module), mode=layout.activation_checkpointing)
    on_meta = any(p.device.type == "meta" for p in module.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True) if on_meta else nullcontext():
        if on_meta:
            module.to_empty(device="cpu")
        one = apply_to_collection(batch, Tensor, lambda t: t[:1].to("cpu") if on_meta else t[:1])
        step = (lambda: module.loss(one)) if has_hook(module, "loss") else (lambda: module.training_step(one, 0))
        return measure_activation_bytes(step, module=module)
