"""Expert parallelism: the routed experts of each MoE layer sharded over the ``ep`` ranks, tokens sent to them.

Applied from outside the single-device :class:`~lightscale.layers.moe.MoE` layer, as a torch ``ParallelStyle``
on its ``experts`` module (the torchtitan way): the stacked weights become DTensors sharded on the expert
dimension (``Shard(0)`` over ``ep``: rank r holds experts ``[r * E/ep, (r+1) * E/ep)``), and the module's one call
``experts(tokens, counts)`` is wrapped:

1. dispatch, before the call: the copies arrive sorted by expert; an all-to-all of the per-expert counts tells
   every rank how many copies it will receive from each rank for each of its experts; an all-to-all of the tokens
   with those uneven splits sends each copy to the rank that holds its expert (autograd: its backward is the
   reverse all-to-all of the gradients); the received copies, grouped by source rank, are regrouped by local expert;
2. the local experts run on their copies (a loop);
3. combine, after the call: the outputs are put back in source-rank order and the reverse all-to-all returns each
   copy to the rank of its token, where the layer weights and sums them as it does on one device.

Every rank computes its own loss on its own batch (ep ranks are data-parallel ranks), and an expert's gradient
arrives summed over the ep ranks' losses: a hook divides it by ``ep`` so it is the mean, like FSDP's reduction of
the dense gradients over dp x ep (when FSDP2 also shards the experts over ``dp_shard``, its divide factor
``dp_shard x ep`` does the same).

Example:
    >>> apply_expert_parallel(moe_layers(model), mesh["ep"])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from lightscale.errors import ConfigurationError
from lightscale.layers.moe import MoE
from lightscale.parallel.mesh import axis, expert_data_mesh


class ExpertParallel(ParallelStyle):
    """Shard a :class:`~lightscale.layers.moe.GroupedExperts` over a 1-D ``ep`` mesh; dispatch and combine
    its tokens by all-to-all. One instance per module (it keeps the splits between dispatch and combine)."""

    def __init__(self) -> None:
        super().__init__()
        self.splits: tuple[list[int], list[int], Tensor] | None = None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_shard_experts,
            input_fn=self._dispatch,
            output_fn=self._combine,
        )

    def _dispatch(self, module: nn.Module, inputs: tuple[Tensor, Tensor], mesh: DeviceMesh) -> tuple[Tensor, Tensor]:
        tokens, counts = inputs
        group, ranks = mesh.get_group(), mesh.size()
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        sent = counts.view(ranks, -1)  # [destination rank, its local expert]
        got = received_counts.view(ranks, -1)  # [source rank, my local expert]
        send_splits, recv_splits = sent.sum(1).tolist(), got.sum(1).tolist()
        received = all_to_all_single_autograd(tokens, recv_splits, send_splits, group)
        order = expert_major_order(got)
        self.splits = (send_splits, recv_splits, order)
        return received[order], got.sum(0)

    def _combine(self, module: nn.Module, output: Tensor, mesh: DeviceMesh) -> Tensor:
        assert self.splits is not None, "combine without a dispatch"
        send_splits, recv_splits, order = self.splits
        self.splits = None
        by_source = output[torch.argsort(order)]
        return all_to_all_single_autograd(by_source, send_splits, recv_splits, mesh.get_group())


def expert_major_order(counts: Tensor) -> Tensor:
    """Row order that regroups copies laid out by (source rank, expert) as (expert, source rank).

    ``counts[s, e]`` copies from source s for expert e arrive contiguous, sources outermost.
    """
    flat = counts.flatten()
    starts = flat.cumsum(0) - flat
    segments = torch.arange(flat.numel()).view(counts.shape).t().flatten()  # (expert, source) order
    lengths = flat[segments]
    segment_of_row = torch.repeat_interleave(segments, lengths)
    first_row = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return starts[segment_of_row] + torch.arange(int(lengths.sum())) - first_row


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    ranks = mesh.size()
    for param_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]), requires_grad=param.requires_grad)
        # Each rank's expert gradient sums the losses of all ep ranks: the mean over ranks is 1/ep of it.
        sharded.register_hook(lambda grad: grad / ranks)
        module.register_parameter(param_name, sharded)


def check_expert_parallel(layers: Sequence[MoE], ep: int) -> None:
    """Raise ConfigurationError if ``ep`` ranks cannot split these layers' experts evenly (or there are none)."""
    if not layers:
        raise ConfigurationError(
            f"ep={ep} shards MoE experts, but the model has no lightscale.layers.moe.MoE layer "
            "(GPT recipe: set model config `moe: {n_experts: ...}`). Use ep=1 for dense models."
        )
    bad = sorted({layer.config.n_experts for layer in layers if layer.config.n_experts % ep})
    if bad:
        raise ConfigurationError(f"ep={ep} must divide every MoE layer's number of experts; it does not divide {bad}.")


def apply_expert_parallel(layers: Sequence[MoE], ep_mesh: DeviceMesh) -> list[ExpertParallel]:
    """Shard the routed experts of ``layers`` over ``ep_mesh`` in place; return the styles (their counters)."""
    check_expert_parallel(layers, ep_mesh.size())
    styles = []
    for layer in layers:
        style = ExpertParallel()
        parallelize_module(layer.experts, ep_mesh, style)
        styles.append(style)
    return styles


def expert_parameters(layers: Sequence[MoE]) -> set[nn.Parameter]:
    """The routed experts' parameters (kept out of the dense part's FSDP groups)."""
    return {param for layer in layers for param in layer.experts.parameters()}


def shard_experts_over_data(
    layers: Sequence[MoE], mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy | None = None
) -> None:
    """FSDP2 on each layer's expert-parallel experts over the ranks holding the same experts (``dp_shard``, times
    ``cp`` under context parallelism: lightscale/parallel/mesh.py's ``expert_data_mesh``).

    Its reduction sums over those ranks; the divide factor makes it the mean over every rank computing gradients
    (dp_shard x ep x cp), as for the dense part.
    """
    replicas = expert_data_mesh(mesh)
    factor = float(replicas.size() * axis(mesh, "ep").size())
    for layer in layers:
        fully_shard(layer.experts, mesh=replicas, mp_policy=mp_policy or MixedPrecisionPolicy())
        layer.experts.set_gradient_divide_factor(factor)
        layer.experts.set_force_sum_reduction_for_comms(True)  # a sum then a division: gloo has no PREMUL_SUM
