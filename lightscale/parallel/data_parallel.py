"""Bucketed data parallelism: gradients all-reduced in buckets while backward is still running.

Parameters are grouped into flat buckets in reverse registration order (roughly the order autograd produces
their gradients). A post-accumulate-grad hook copies each gradient into its bucket; when a bucket is full
its all-reduce starts asynchronously, strictly in bucket order so every rank issues the same collectives in
the same sequence. At the end of backward (an autograd engine callback) the remaining buckets are
launched, all are waited on, and each ``param.grad`` is a view into its averaged bucket, so gradient
clipping and the optimizer see the synchronized gradients exactly as with ``torch.nn.parallel.DDP``.

Example:
    >>> reducer = BucketedGradReducer(model, bucket_cap_mb=25)
    >>> loss_fn(model(x)).backward()   # gradients are averaged over ranks when this returns
    >>> with reducer.no_sync():        # gradient-accumulation micro-step: no communication
    ...     loss_fn(model(x)).backward()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightscale.errors import ConfigurationError
from lightscale.parallel.powersgd import PowerSGD, validate_powersgd

Compression = Literal["none", "bf16", "fp16", "powersgd"]
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_MB = 1024 * 1024


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    flat: Tensor  # gradients, in the parameters' dtype
    wire: Tensor | None = None  # compressed copy sent over the network
    pending: int = 0
    handle: dist.Work | None = None
    then: Any = None  # the second reduction's work (``after_reduce``)
    ready: set[int] = field(default_factory=set)

    def slot(self, index: int) -> Tensor:
        param = self.params[index]
        start = self.offsets[index]
        return self.flat[start : start + param.numel()].view_as(param)


class BucketedGradReducer:
    """Averages gradients of ``module`` over ``process_group`` with bucketed, overlapped all-reduces.

    Args:
        module: the (single-device) model; parameters are hooked, the module is not wrapped.
        bucket_cap_mb: bucket size in MiB; larger buckets mean fewer, bigger messages.
        first_bucket_cap_mb: size of the first bucket (the last layers), kept small so communication starts early.
        compression: ``"bf16"``/``"fp16"`` halve the bytes on the wire (the sum is taken in that dtype);
            ``"powersgd"`` sends low-rank factors of each gradient matrix (lightscale/parallel/powersgd.py).
        find_unused_parameters: reduce zeros for parameters that got no gradient instead of raising.
        process_group: the data-parallel group (default: the world).
        broadcast_from_rank0: copy rank 0's parameters and buffers to every rank first.
        broadcast_buffers: let :meth:`sync_buffers` copy rank 0's buffers (call it before each forward).
        powersgd_rank: rank of PowerSGD's factors (``compression="powersgd"``).
        powersgd_warmup_steps: reductions done uncompressed before PowerSGD starts.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        compression: Compression = "none",
        find_unused_parameters: bool = False,
        process_group: dist.ProcessGroup | None = None,
        broadcast_from_rank0: bool = True,
        broadcast_buffers: bool = True,
        powersgd_rank: int = 4,
        powersgd_warmup_steps: int = 0,
    ) -> None:
        validate_reducer_settings(bucket_cap_mb, first_bucket_cap_mb, compression)
        validate_powersgd(powersgd_rank, powersgd_warmup_steps)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.find_unused_parameters = find_unused_parameters
        self.require_sync = True
        if broadcast_from_rank0:
            broadcast_module_state(module, process_group=process_group)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        caps = (int(first_bucket_cap_mb * _MB), int(bucket_cap_mb * _MB))
        self.buckets = _build_buckets(named[::-1], caps, _WIRE_DTYPES.get(compression))
        self._where = {id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)}
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in named
        ]
        self._where_params = [p for _, p in named]
        self._buffers = list(module.buffers()) if broadcast_buffers else []
        self._scale = 1.0 / self.world_size
        self._next_launch = 0
        self._graph_task: int | None = None
        self.powersgd: PowerSGD | None = None
        if compression == "powersgd":
            self.powersgd = PowerSGD(
                self.buckets, rank=powersgd_rank, warmup_steps=powersgd_warmup_steps, process_group=process_group
            )
        self._compressing = False  # PowerSGD on in this backward (decided at its first gradient)
        # A second reduction of each averaged bucket (fault tolerance: across replicas), launched in bucket order as
        # each bucket's first finishes, so it overlaps the rest of backward; its work's wait() when backward ends.
        self.after_reduce: Callable[[Tensor], Any] | None = None
        self._next_after = 0

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this block."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def remove(self) -> None:
        """Detach the hooks; the module trains locally afterwards."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def sync_buffers(self) -> None:
        """Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank, as torch DDP does each forward."""
        if self._buffers:
            broadcast_tensors(self._buffers, process_group=self.process_group)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return
        graph_task = torch._C._current_graph_task_id()
        if graph_task != self._graph_task:
            # First gradient of this backward. Resetting here also drops state a failed backward left behind.
            self._reset()
            self._graph_task = graph_task
            self._compressing = self.powersgd is not None and self.powersgd.compressing
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b, i = self._where[id(param)]
        bucket = self.buckets[b]
        _move_grad_into(bucket, i, self._scale)
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                break
            if self._compressing:
                self.powersgd.launch(self._next_launch)
            else:
                payload = bucket.flat if bucket.wire is None else bucket.wire.copy_(bucket.flat)
                bucket.handle = dist.all_reduce(payload, group=self.process_group, async_op=True)
            self._next_launch += 1
        self._launch_after(wait=False)

    def _launch_after(self, *, wait: bool) -> None:
        """``after_reduce`` of each bucket whose own all-reduce finished, strictly in bucket order (the same order on
        every rank); ``wait``: of every launched bucket."""
        if self.after_reduce is None or self._compressing:
            return
        while self._next_after < self._next_launch:
            bucket = self.buckets[self._next_after]
            if not wait and not bucket.handle.is_completed():
                return
            _wait_bucket(bucket)
            bucket.then = self.after_reduce(bucket.flat)
            self._next_after += 1

    def _finish_backward(self) -> None:
        try:
            unused = [(bucket, i) for bucket in self.buckets for i in _unready(bucket)]
            if unused and not self.find_unused_parameters:
                self._wait_launched()  # leave no collective of ours in flight
                names = [bucket.names[i] for bucket, i in unused]
                raise RuntimeError(
                    f"bucketed_ddp: {len(names)} parameter(s) received no gradient in this backward pass: "
                    f"{names[:8]}{' ...' if len(names) > 8 else ''}. Use them in the loss, set requires_grad=False "
                    "on them, or pass find_unused_parameters=True to reduce zeros for them."
                )
            for bucket, i in unused:
                _move_grad_into(bucket, i, self._scale)
                bucket.ready.add(i)
            self._launch_in_order()
            if self.find_unused_parameters:
                self._drop_grads_unused_everywhere(unused)
            self._launch_after(wait=True)
            self._wait_launched()
            if self.powersgd is not None:
                self.powersgd.step += 1  # one synchronized backward per optimizer step
        finally:
            self._reset()

    def _drop_grads_unused_everywhere(self, unused: list[tuple[_Bucket, int]]) -> None:
        # Like torch DDP: a parameter no rank used keeps grad=None, so the optimizer leaves it alone.
        used = torch.ones(len(self._where), device=self.buckets[0].flat.device)
        index = {id(p): n for n, p in enumerate(self._where_params)}
        for bucket, i in unused:
            used[index[id(bucket.params[i])]] = 0
        dist.all_reduce(used, group=self.process_group)
        for bucket, i in unused:
            if used[index[id(bucket.params[i])]] == 0:
                bucket.params[i].grad = None

    def _wait_launched(self) -> None:
        if self._compressing:
            self.powersgd.finish(self._next_launch)
            return
        for bucket in self.buckets[: self._next_launch]:
            if bucket.then is not None:
                bucket.then.wait()  # its own all-reduce was waited before the second one started
            else:
                _wait_bucket(bucket)

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.handle = None
            bucket.then = None
        self._next_launch = 0
        self._next_after = 0
        self._graph_task = None


def _wait_bucket(bucket: _Bucket) -> None:
    if bucket.handle is not None:
        bucket.handle.wait()
        bucket.handle = None
        if bucket.wire is not None:
            bucket.flat.copy_(bucket.wire)


def validate_reducer_settings(bucket_cap_mb: float, first_bucket_cap_mb: float, compression: str) -> None:
    """Checked at strategy construction too, so bad values fail before any process starts."""
    validate_bucket_cap("bucket_cap_mb", bucket_cap_mb)
    validate_bucket_cap("first_bucket_cap_mb", first_bucket_cap_mb)
    if compression not in ("none", *_WIRE_DTYPES, "powersgd"):
        raise ConfigurationError(
            f"compression={compression!r} is not valid; choose one of 'none', 'bf16', 'fp16', 'powersgd'."
        )


def validate_bucket_cap(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigurationError(
            f"{name}={value!r} is not valid: a bucket size in MiB must be a positive number, e.g. 25."
        )


def _unready(bucket: _Bucket) -> list[int]:
    return [i for i in range(len(bucket.params)) if i not in bucket.ready]


def _move_grad_into(bucket: _Bucket, index: int, scale: float) -> None:
    """Make ``param.grad`` a view of its bucket slot holding ``scale * grad`` (zeros for no gradient).

    Scaling by 1/world_size while copying saves a pass over the bucket: the all-reduced sum is the mean.
    """
    param, slot = bucket.params[index], bucket.slot(index)
    grad = param.grad
    if grad is not None and grad.data_ptr() == slot.data_ptr():
        slot.mul_(scale)  # accumulated in place into the bucket (zero_grad(set_to_none=False))
    elif grad is None:
        slot.zero_()  # an unused parameter contributes zeros (find_unused_parameters=True)
    else:
        torch.mul(grad, scale, out=slot)
    param.grad = slot


def size_buckets(tensors: Iterable[Tensor], caps: tuple[int, int]) -> list[list[Tensor]]:
    """Consecutive tensors of one dtype and device, grouped up to ``caps[0]`` bytes in the first bucket and
    ``caps[1]`` in each later one (a larger tensor goes alone)."""
    groups: list[list[Tensor]] = []
    size = 0
    for tensor in tensors:
        cap = caps[0] if len(groups) <= 1 else caps[1]
        nbytes = tensor.numel() * tensor.element_size()
        same_kind = groups and _kind(groups[-1][0]) == _kind(tensor)
        if not groups or not same_kind or (size + nbytes > cap and size > 0):
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += nbytes
    return groups


def _build_buckets(
    named: list[tuple[str, nn.Parameter]], caps: tuple[int, int], wire_dtype: torch.dtype | None
) -> list[_Bucket]:
    names = {id(param): name for name, param in named}
    groups = size_buckets([param for _, param in named], caps)
    return [_make_bucket([(names[id(param)], param) for param in group], wire_dtype) for group in groups]


def _wire_buffer(flat: Tensor, wire_dtype: torch.dtype) -> Tensor | None:
    if wire_dtype == flat.dtype:
        return None  # gradients already travel in that dtype
    if torch.empty((), dtype=wire_dtype).element_size() >= flat.element_size():
        raise ConfigurationError(
            f"compression to {wire_dtype} saves nothing for {flat.dtype} parameters (and fp16 would overflow where "
            f"bf16 does not); use compression='none' or 'bf16'."
        )
    return torch.zeros(flat.numel(), dtype=wire_dtype, device=flat.device)


def _kind(param: Tensor) -> tuple[torch.dtype, torch.device]:
    return param.dtype, param.device


def _make_bucket(group: list[tuple[str, nn.Parameter]], wire_dtype: torch.dtype | None) -> _Bucket:
    params = [p for _, p in group]
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += param.numel()
    flat = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    wire = None if wire_dtype is None else _wire_buffer(flat, wire_dtype)
    return _Bucket(params=params, names=[n for n, _ in group], offsets=offsets, flat=flat, wire=wire)


def broadcast_module_state(module: nn.Module, *, src: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
    """Copy parameters and buffers from rank ``src`` of the group to every rank (meta tensors hold no values: skipped;
    materialization draws them alike on every rank)."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not t.is_meta]
    broadcast_tensors(tensors, src=src, process_group=process_group)


@torch.no_grad()
def broadcast_tensors(tensors: list[Tensor], *, src: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
    """Broadcast ``tensors`` in place from rank ``src`` of the group, one flat message per dtype and device."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault(_kind(tensor), []).append(tensor)
    for group in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, group=process_group, group_src=src)
        for tensor, synced in zip(group, flat.split([t.numel() for t in group]), strict=True):
            tensor.copy_(synced.view_as(tensor))
