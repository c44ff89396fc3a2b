"""Counting collectives exactly: calls, elements and bytes per kind, as the process issues them.

:class:`CollectiveCounter` is a ``TorchDispatchMode`` that sees every collective at the dispatcher: the c10d ops
behind ``torch.distributed``'s functions (what bucketed_ddp, FSDP2 and DeepSpeed call), the functional collectives
DTensor issues for tensor parallelism, and point-to-point sends (pipelines). One counter serves the CommMonitor
callback and the exact-communication tests.

A collective's elements are those of its whole buffer: the tensor all-reduced or broadcast, the gathered output of
an all-gather, the input of a reduce-scatter or all-to-all, the tensor sent or received. A c10d collective also records
the global ranks of its group (which link it crossed: e.g. inside a node or between nodes).

Example:
    >>> with CollectiveCounter() as counter:
    ...     dist.all_reduce(torch.ones(4))
    >>> counter.totals()["all_reduce"]
    Traffic(calls=1, elements=4, bytes=16)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional
_funcol_autograd = torch.ops._c10d_functional_autograd

KINDS: dict[Any, str] = {
    _c10d.allreduce_: "all_reduce",
    _c10d.allreduce_coalesced_: "all_reduce",
    _funcol.all_reduce: "all_reduce",
    _funcol.all_reduce_coalesced: "all_reduce",
    _c10d._allgather_base_: "all_gather",
    _c10d.allgather_: "all_gather",
    _c10d.allgather_coalesced_: "all_gather",
    _c10d.allgather_into_tensor_coalesced_: "all_gather",
    _funcol.all_gather_into_tensor: "all_gather",
    _funcol.all_gather_into_tensor_coalesced: "all_gather",
    _c10d._reduce_scatter_base_: "reduce_scatter",
    _c10d.reduce_scatter_: "reduce_scatter",
    _c10d.reduce_scatter_tensor_coalesced_: "reduce_scatter",
    _funcol.reduce_scatter_tensor: "reduce_scatter",
    _funcol.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _c10d.alltoall_: "all_to_all",
    _c10d.alltoall_base_: "all_to_all",
    _funcol.all_to_all_single: "all_to_all",
    _funcol_autograd.all_to_all_single: "all_to_all",
    _c10d.broadcast_: "broadcast",
    _funcol.broadcast: "broadcast",
    _c10d.send: "send",
    _c10d.recv_: "recv",
}


@dataclass
class Traffic:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class Collective:
    kind: str
    elements: int
    bytes: int
    ranks: tuple[int, ...] = ()  # the group's global ranks (c10d ops; functional collectives leave it empty)


class CollectiveCounter(TorchDispatchMode):
    """Records each collective dispatched while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        kind = KINDS.get(getattr(func, "_overloadpacket", None))
        if kind is not None:
            self.calls.append(_measure(kind, [*args, *(kwargs or {}).values()], out, _group_ranks(args)))
        return out

    def totals(self, *, min_bytes: int = 0) -> dict[str, Traffic]:
        """Calls, elements and bytes per kind, leaving out collectives under ``min_bytes`` (scalar metric syncs)."""
        totals: dict[str, Traffic] = {}
        for call in self.calls:
            if call.bytes >= min_bytes:
                entry = totals.setdefault(call.kind, Traffic())
                entry.calls += 1
                entry.elements += call.elements
                entry.bytes += call.bytes
        return totals

    def reset(self) -> None:
        self.calls.clear()


def _measure(kind: str, args: list[Any], out: Any, ranks: tuple[int, ...]) -> Collective:
    buffers = [_size(arg) for arg in args] + [_size(out)] if kind == "all_gather" else [_size(arg) for arg in args]
    elements, nbytes = max(buffers, default=(0, 0))
    return Collective(kind, elements, nbytes, ranks)


def _group_ranks(args: tuple) -> tuple[int, ...]:
    """The global ranks of the process group a c10d op was given (it travels as a boxed ScriptObject)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg)))
    return ()


def _size(value: Any) -> tuple[int, int]:
    """Elements and bytes of a tensor, or of all tensors in a (nested) list of them."""
    if isinstance(value, Tensor):
        return value.numel(), value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        sizes = [_size(item) for item in value if isinstance(item, (Tensor, list, tuple))]
        return sum(e for e, _ in sizes), sum(b for _, b in sizes)
    return 0, 0


# Bytes each rank puts on the link per byte of the collective's buffer, for ring algorithms over n ranks.
_WIRE_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
}


class SlowLink(CollectiveCounter):
    """A simulated slow link between ``ranks`` sites (two "datacenters" on one machine): after each collective the
    issuing rank waits for the time its ring traffic would take at ``bytes_per_second``.

    Time is added where the collective is issued, so communication never overlaps compute here: the pessimistic
    case for synchronous data parallelism, which would hide part of it behind backward on a real link.

    Example:
        >>> with SlowLink(bytes_per_second=10e6, ranks=2):
        ...     trainer.fit(model, data)  # each all-reduce of B bytes costs B / 10 MB/s more
    """

    def __init__(self, *, bytes_per_second: float, ranks: int) -> None:
        super().__init__()
        if not bytes_per_second > 0 or ranks < 2:
            raise ValueError(f"SlowLink needs bytes_per_second > 0 and ranks >= 2, got {bytes_per_second}, {ranks}.")
        self.bytes_per_second = bytes_per_second
        self.ranks = ranks
        self.seconds_waited = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        before = len(self.calls)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for call in self.calls[before:]:
            seconds = call.bytes * _WIRE_FACTOR[call.kind](self.ranks) / self.bytes_per_second
            self.seconds_waited += seconds
            time.sleep(seconds)
        return out
