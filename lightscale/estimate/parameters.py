"""The parameter tensors one rank holds before data-parallel sharding: its pipeline stages, split by the TP plan.

Read from the model's own hooks (lightscale/parallel/contract.py), on a model built on the meta device, so the
split is the one the strategy will apply, and a 70B model costs nothing to inspect.

Example:
    >>> sum(rank_parameter_sizes(module, layout_of("tp2", world_size=4)))
    5_407_232
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightscale.estimate.memory_layout import Layout
from lightscale.layers.moe import MoE
from lightscale.parallel.contract import network_of, tp_plan_of
from lightscale.parallel.pipeline import stage_ids
from lightscale.parallel.tensor_parallel import matching_modules

# A parameter's global size: a live model's strategy answers it (lightscale/strategies/shards.py ``global_numel``: a
# ZeRO-3 partition is empty in place) and is passed in from above; a model built for the estimate is whole.
Numel = Callable[[Tensor], int]


def own_numel(tensor: Tensor) -> int:
    return tensor.numel()


def rank_parameter_sizes(module: nn.Module, layout: Layout, *, numel: Numel = own_numel) -> list[int]:
    """Element counts of the parameter tensors on the most loaded rank (tied tensors once per stage)."""
    dense, experts = rank_parameter_split(module, layout, numel=numel)
    return dense + experts


def rank_parameter_split(module: nn.Module, layout: Layout, *, numel: Numel = own_numel) -> tuple[list[int], list[int]]:
    """(dense, routed-expert) element counts on the most loaded rank; experts already divided over ``layout.ep``.
    ``numel``: each parameter's global size (the running strategy's ``global_numel`` for a live model)."""
    network = network_of(module)
    tp_divisor = _tp_divisors(module, network, layout)
    expert_names = _routed_expert_parameters(network)
    per_rank = []
    for names in _rank_modules(module, network, layout):
        seen: dict[int, tuple[int, bool]] = {}
        for pname, param in _parameters_of(network, names):
            expert = pname in expert_names
            size = numel(param) // (layout.ep if expert else tp_divisor.get(pname, 1))
            seen.setdefault(id(param), (size, expert))
        per_rank.append(list(seen.values()))
    chosen = max(per_rank, key=lambda sizes: sum(size for size, _ in sizes))
    return [size for size, expert in chosen if not expert], [size for size, expert in chosen if expert]


def _routed_expert_parameters(network: nn.Module) -> set[str]:
    """Names of the stacked routed-expert weights (expert parallelism splits them on dim 0; shared experts stay)."""
    return {
        f"{name}.experts.{pname}"
        for name, sub in network.named_modules()
        if isinstance(sub, MoE)
        for pname, _ in sub.experts.named_parameters()
    }


def whole_gradient_elements(module: nn.Module, layout: Layout) -> int:
    """Elements by which gradients exceed their sharded parameters under tensor parallelism: DTensor's embedding
    backward hands a row-wise (vocabulary-sharded) table its gradient replicated, and it stays so until the
    optimizer step; a table tied to a column-wise head (GPT's token table) sums into the head's sharded one."""
    if layout.tp == 1 or layout.dp_shard > 1:
        return 0  # FSDP's reduce-scatter hands back the shard
    network = network_of(module)
    plan = tp_plan_of(module, sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel)
    colwise = {
        id(network.get_submodule(name).weight)
        for pattern, style in plan.items()
        if isinstance(style, ColwiseParallel)
        for name in matching_modules(network, pattern)
    }
    extra = 0
    for pattern, style in plan.items():
        if not isinstance(style, RowwiseParallel):
            continue
        for name in matching_modules(network, pattern):
            sub = network.get_submodule(name)
            if isinstance(sub, nn.Embedding) and id(sub.weight) not in colwise:
                extra += sub.weight.numel() - sub.weight.numel() // layout.tp
    return extra


def _rank_modules(module: nn.Module, network: nn.Module, layout: Layout) -> list[list[str]]:
    """Module names (in the network) each pipeline rank holds; one rank holding everything without pipelines."""
    if layout.pp == 1:
        return [[""]]
    stages = module.pipeline_stages(layout.num_stages)  # type: ignore[attr-defined]
    return [
        [
            name
            for stage in stage_ids(rank, layout.pp, layout.stages_per_rank, v_shape=layout.v_shape)
            for name in stages[stage]
        ]
        for rank in range(layout.pp)
    ]


def _parameters_of(network: nn.Module, names: list[str]) -> Iterator[tuple[str, nn.Parameter]]:
    for name in names:
        sub = network.get_submodule(name) if name else network
        prefix = f"{name}." if name else ""
        for pname, param in sub.named_parameters(remove_duplicate=False):
            yield prefix + pname, param


def _tp_divisors(module: nn.Module, network: nn.Module, layout: Layout) -> dict[str, int]:
    """Parameter name -> tp for the tensors the plan shards (Colwise: weight and bias; Rowwise: weight)."""
    if layout.tp == 1:
        return {}
    plan = tp_plan_of(module, sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel)
    divisors: dict[str, int] = {}
    for pattern, style in plan.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue  # SequenceParallel and PrepareModule* keep the parameters replicated
        sharded = ("weight", "bias") if isinstance(style, ColwiseParallel) else ("weight",)
        for name in matching_modules(network, pattern):
            divisors |= {f"{name}.{p}": layout.tp for p in sharded}
    return divisors
