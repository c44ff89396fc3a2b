"""DiLoCo and local SGD: workers train alone for ``H`` inner steps, then meet over the outer process group.

Every rank keeps its own inner optimizer and inner data parallelism; this class only touches the parameters it
was given and talks only over ``group``: one rank per worker, the ranks that hold the same piece of the model in
each worker (with plain DDP inside a worker, all ranks of the same position; with ZeRO/FSDP, the same shard).

``mode="diloco"``: the pseudo-gradient ``global - local`` is averaged over the workers and an outer optimizer
(default: SGD with Nesterov momentum, lr and momentum by ``H`` from :func:`default_outer_step`) steps an fp32 copy
of the global parameters, which every worker then continues from. ``mode="local_sgd"``: the parameters themselves
are averaged. With ``synchronous_steps=W`` the first ``W`` inner steps are plain data parallelism instead (the
caller averages every step's gradients with :meth:`OuterSync.average_gradients`; post-local SGD, Lin et al. 2020):
the workers stay identical, and the rounds start from where synchronous training got to. What it may be configured
with, the defaults and the refusals are parallel/diloco/outer_settings.py's.

Example (each rank of a 2-worker gloo job, one rank per worker):
    >>> sync = OuterSync(model.named_parameters(), sync_every=4)
    >>> for step, batch in enumerate(batches, start=1):
    ...     loss_fn(model(batch)).backward(); inner.step(); inner.zero_grad()
    ...     sync.after_inner_step(step)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightscale.errors import ConfigurationError
from lightscale.parallel.data_parallel import size_buckets
from lightscale.parallel.diloco.outer_settings import (
    Mode,
    OuterOptimizerFactory,
    Reducer,
    build_outer_optimizer,
    check_outer_sync,
    check_reduce,
    check_saved_settings,
    default_outer_step,
    sgd_outer_optimizer,
)
from lightscale.parallel.diloco.schedule import Schedule, split_fragments
from lightscale.parallel.diloco.wire import Codec, Compression

GRADIENT_BUCKET_BYTES = 64 << 20  # synchronous steps: the extra memory a bucket's flat copy takes at most


@dataclass
class _Fragment:
    indices: list[int]  # positions in OuterSync.params
    codec: Codec
    globals: list[Tensor]  # fp32 global parameters: what the outer optimizer steps (local_sgd: the last average)
    optimizer: torch.optim.Optimizer | None
    residual: Tensor | None  # error feedback: what compression left out of the last payload


@dataclass
class _Pending:
    fragment: int
    apply_at: int
    work: Any = None
    payload: Tensor | None = None
    gathered: list[Tensor] | None = None
    mean: Tensor | None = None  # set once the collective is waited on
    skipped: bool = False  # the reducer dropped this round (fault_tolerant.py: a worker failed during it)


class OuterSync:
    """Averages pseudo-gradients (or parameters) over ``group`` every ``sync_every`` inner steps.

    Args:
        named_parameters: ``(name, tensor)`` pairs of this rank's model (``model.named_parameters()``).
        sync_every: ``H``, inner steps between two syncs of the same fragment.
        group: the outer process group (``None``: the default group, i.e. one rank per worker).
        mode: ``"diloco"`` (outer optimizer on averaged pseudo-gradients) or ``"local_sgd"`` (average parameters).
        outer_optimizer: builds the outer optimizer from a list of fp32 tensors (diloco only; default SGD with
            :func:`default_outer_step` for ``sync_every``). One is built per fragment.
        fragments: ``k``; the model is split into ``k`` contiguous fragments that sync at staggered steps.
        overlap_steps: inner steps a fragment's collective runs behind; its result is applied that many steps
            after it was sent (0: at once). Local progress on that fragment in between is replaced by the result.
        compression: ``"none"`` (fp32 all-reduce), ``"bf16"`` or ``"int8"`` (per-tensor absmax, all-gathered and
            summed in fp32, with error feedback). diloco only: compressing parameters themselves loses them.
        broadcast_start: copy worker 0's parameters to every worker first, so all start from the same point.
        reduce: replaces the collective over ``group`` (then unused): takes this worker's flat fp32 payload and
            returns the workers' mean, or ``None`` to skip the round: no outer step, and the parameters go back
            to the global ones. Needs ``compression="none"`` and ``overlap_steps=0``; whoever supplies it also
            syncs the start (``broadcast_start`` is ignored). :mod:`.fault_tolerant` passes one that goes through
            torchft, so that the mean is over the workers alive in that round.
        synchronous_steps: inner steps at the start whose gradients the caller averages over ``group`` with
            :meth:`average_gradients` (synchronous data parallelism); the rounds start after them. Not with
            ``reduce``: synchronous steps need every worker in one job.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        *,
        sync_every: int,
        group: dist.ProcessGroup | None = None,
        mode: Mode = "diloco",
        outer_optimizer: OuterOptimizerFactory | None = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        compression: Compression = "none",
        broadcast_start: bool = True,
        reduce: Reducer | None = None,
        synchronous_steps: int = 0,
    ) -> None:
        named = list(named_parameters)
        check_outer_sync(named, mode, compression, outer_optimizer)
        check_reduce(reduce, compression, overlap_steps, synchronous_steps)
        self.schedule = Schedule(sync_every, fragments, overlap_steps)
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self.group, self.mode, self.compression = group, mode, compression
        self.reduce, self.synchronous_steps = reduce, synchronous_steps
        self.world = 1 if reduce is not None else dist.get_world_size(group)
        if broadcast_start and reduce is None:
            self._broadcast_start()
        factory = outer_optimizer or sgd_outer_optimizer(*default_outer_step(sync_every))
        sizes = [p.numel() for p in self.params]
        self.fragments = [self._fragment(ids, factory) for ids in split_fragments(sizes, fragments)]
        self.step = 0  # inner steps done
        self.bytes_sent = 0  # payload bytes this rank handed to outer collectives
        self._pending: list[_Pending] = []

    def _fragment(self, indices: list[int], factory: OuterOptimizerFactory) -> _Fragment:
        codec = Codec(self.compression, [self.local(i).numel() for i in indices])
        residual = None if self.compression == "none" else torch.zeros(codec.numel, device=self.params[0].device)
        globals_ = [self.local(i).float().clone() for i in indices]
        optimizer = None if self.mode == "local_sgd" else build_outer_optimizer(factory, globals_)
        return _Fragment(indices, codec, globals_, optimizer, residual)

    def local(self, index: int) -> Tensor:
        """This rank's values of parameter ``index``: its local shard when sharded (a DTensor, FSDP2 inside)."""
        param = self.params[index].detach()
        return param.to_local() if isinstance(param, DTensor) else param

    def named_globals(self) -> list[tuple[str, Tensor]]:
        """``(name, fp32 global tensor)`` in parameter order: this rank's shard of the model every worker shares."""
        by_index = {i: g for f in self.fragments for i, g in zip(f.indices, f.globals, strict=True)}
        return [(self.names[i], by_index[i]) for i in range(len(self.params))]

    @property
    def synchronous(self) -> bool:
        """Whether the next inner step is one of the synchronous first steps (average its gradients)."""
        return self.step < self.synchronous_steps

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Average this rank's gradients over the workers (call between backward and the inner step), in flat
        buckets of one dtype. A gradient missing here becomes zeros, so that every worker takes the same step."""
        grads = []
        for param in (p for p in self.params if p.requires_grad):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad)
        for bucket in size_buckets(grads, (GRADIENT_BUCKET_BYTES, GRADIENT_BUCKET_BYTES)):
            flat = torch.cat([grad.reshape(-1) for grad in bucket])
            dist.all_reduce(flat, group=self.group)
            flat /= self.world
            for grad, value in zip(bucket, flat.split([grad.numel() for grad in bucket]), strict=True):
                grad.copy_(value.view_as(grad))

    @torch.no_grad()
    def _broadcast_start(self) -> None:
        for index in range(len(self.params)):
            dist.broadcast(self.local(index), group=self.group, group_src=0)

    @torch.no_grad()
    def after_inner_step(self, step: int) -> None:
        """Call after inner optimizer step number ``step`` (counted from 1): applies and sends what is due."""
        if step != self.step + 1:
            raise ConfigurationError(
                f"after_inner_step({step}) was called after step {self.step}; call it once after every inner "
                f"optimizer step, with consecutive step numbers starting at 1 (or load_state_dict first)."
            )
        self.step = step
        if step <= self.synchronous_steps:  # every worker took the same step: the global model is theirs
            for fragment in self.fragments:
                for i, tensor in zip(fragment.indices, fragment.globals, strict=True):
                    tensor.copy_(self.local(i))
            return
        for pending in [p for p in self._pending if p.apply_at == step]:
            self._apply(pending)
        for index in self.schedule.sends_at(step):
            self._pending.append(self._send(index))
            if self.schedule.overlap_steps == 0:
                self._apply(self._pending[-1])

    @torch.no_grad()
    def flush(self) -> None:
        """Apply every collective still in flight now (at the end of training)."""
        for pending in list(self._pending):
            self._apply(pending)

    def _flat_local(self, fragment: _Fragment) -> Tensor:
        return torch.cat([self.local(i).reshape(-1).float() for i in fragment.indices])

    def _send(self, index: int) -> _Pending:
        fragment = self.fragments[index]
        if self.mode == "diloco":
            flat = torch.cat([g.reshape(-1) for g in fragment.globals]) - self._flat_local(fragment)
        else:
            flat = self._flat_local(fragment)
        if fragment.residual is not None:
            flat += fragment.residual
        payload = fragment.codec.encode(flat)
        if fragment.residual is not None:
            fragment.residual = flat - fragment.codec.decode(payload)
        self.bytes_sent += fragment.codec.payload_bytes
        pending = _Pending(index, self.step + self.schedule.overlap_steps, payload=payload)
        if self.reduce is not None:
            pending.mean = self.reduce(payload)
            pending.skipped = pending.mean is None
        elif self.compression == "none":
            pending.work = dist.all_reduce(payload, group=self.group, async_op=True)
        else:
            pending.gathered = [torch.empty_like(payload) for _ in range(self.world)]
            pending.work = dist.all_gather(pending.gathered, payload, group=self.group, async_op=True)
        return pending

    def _resolve(self, pending: _Pending) -> Tensor:
        """Wait for the collective and return the workers' mean in fp32 (summed in worker order on every rank)."""
        if pending.mean is None and not pending.skipped:
            pending.work.wait()
            codec = self.fragments[pending.fragment].codec
            if pending.gathered is None:
                total = pending.payload
            else:
                total = torch.zeros(codec.numel, device=pending.payload.device)
                for payload in pending.gathered:
                    total += codec.decode(payload)
            pending.mean, pending.work, pending.payload, pending.gathered = total / self.world, None, None, None
        return pending.mean

    def _apply(self, pending: _Pending) -> None:
        mean = self._resolve(pending)
        self._pending.remove(pending)
        fragment = self.fragments[pending.fragment]
        if pending.skipped:
            self._restore_globals(fragment)
            return
        for tensor, value in zip(fragment.globals, mean.split(fragment.codec.sizes), strict=True):
            if fragment.optimizer is not None:
                tensor.grad = value.view_as(tensor)
            else:
                tensor.copy_(value.view_as(tensor))
        if fragment.optimizer is not None:
            fragment.optimizer.step()
            fragment.optimizer.zero_grad(set_to_none=True)
        for i, source in zip(fragment.indices, fragment.globals, strict=True):
            self.local(i).copy_(source)

    def _restore_globals(self, fragment: _Fragment) -> None:
        """A skipped round's local progress is dropped (as torchft's DiLoCo does); local_sgd keeps it."""
        for i, source in zip(fragment.indices, fragment.globals, strict=True):
            self.local(i).copy_(source)

    def state_dict(self) -> dict[str, Any]:
        """Global parameters, outer optimizer states, error-feedback residuals, the step and results in flight.

        Collectives in flight are waited on (their means are saved), so a run resumed from this state applies
        them at the same step as the uninterrupted run does.
        """
        pending = [
            {"fragment": p.fragment, "apply_at": p.apply_at, "mean": self._resolve(p).clone()} for p in self._pending
        ]
        return {
            "settings": self._settings(),
            "step": self.step,
            "bytes_sent": self.bytes_sent,
            "global_params": {name: tensor.clone() for name, tensor in self.named_globals()},
            "outer_optimizers": [f.optimizer.state_dict() if f.optimizer else None for f in self.fragments],
            "residuals": [None if f.residual is None else f.residual.clone() for f in self.fragments],
            "pending": pending,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the settings must be those it was saved with."""
        check_saved_settings(state["settings"], self._settings())
        self.step, self.bytes_sent = state["step"], state["bytes_sent"]
        for name, tensor in self.named_globals():
            tensor.copy_(state["global_params"][name])
        for fragment, optimizer_state, residual in zip(
            self.fragments, state["outer_optimizers"], state["residuals"], strict=True
        ):
            if fragment.optimizer is not None:
                fragment.optimizer.load_state_dict(optimizer_state)
            if residual is not None:
                fragment.residual = residual.clone()
        self._pending = [_Pending(p["fragment"], p["apply_at"], mean=p["mean"].clone()) for p in state["pending"]]

    def _settings(self) -> dict[str, Any]:
        schedule = self.schedule
        settings = dict(
            mode=self.mode,
            compression=self.compression,
            sync_every=schedule.sync_every,
            fragments=schedule.fragments,
            overlap_steps=schedule.overlap_steps,
        )
        # Only when set, so that states saved before the setting existed still load; a run saved without it
        # cannot turn synchronous later (its workers have already parted).
        return settings | ({"synchronous_steps": self.synchronous_steps} if self.synchronous_steps else {})
