"""torch.optim.Muon on ZeRO's flat partitions: each matrix orthogonalized whole and once, by one owner rank.

DeepSpeed hands the optimizer this rank's flat fp32 partition (1-D, with its 1-D gradient), one parameter group
(ZeRO-3: one sub-group) at a time. ZeRO-1/2 lay each group's parameters end to end in one flat buffer and split it
into equal partitions, one per rank; ZeRO-3 splits each parameter into equal pieces, one per rank, and lays a
sub-group's pieces end to end. Either way a matrix's elements, flattened, are its pieces on the ranks in rank order.
torch's Muon refuses such a partition (``Param gradient must be a 2D matrix``). Here Muon's momentum, Nesterov update
and weight decay, which are elementwise, run on the flat partition as it is; the Newton-Schulz iteration runs on each
matrix whole: the ranks holding pieces of it send them (bf16, the iteration's first cast) to an owner, which runs
torch's own iteration once and sends each piece back (lightscale/optim/muon.py ``orthogonalize_splits``, the same
code ShardedMuon uses under fsdp2); a matrix lying inside one rank's partition is orthogonalized there and moves no
bytes. Each piece is then applied with the learning rate adjusted by the matrix's global shape, as torch does.

The strategy says where each matrix lies (:meth:`FlatMuon.attach`, from strategies/deepspeed/partition.py, the one place
that reads DeepSpeed's layout) once the engine is built. State: torch's ``momentum_buffer``, one value per element of
the flat partition, so the portable checkpoint holds it per parameter as one process's Muon does.

Example:
    >>> optimizer = flat_muon_from(torch.optim.Muon(matrices, lr=0.02))   # before deepspeed.initialize
    >>> optimizer.attach(flat_groups(engine.optimizer))                    # after it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightscale.errors import ConfigurationError
from lightscale.optim.closure import closure_loss
from lightscale.optim.muon import Split, adjust_lr, orthogonalize_splits


@dataclass(frozen=True)
class FlatSpan:
    """One parameter of a flat partition: its shape, its element count on each rank, and where this rank's piece
    starts in this rank's flat partition (its other elements on a rank, if any, are padding)."""

    shape: torch.Size
    sizes: tuple[int, ...]  # elements on each rank of the group, in group rank order
    offset: int  # start of this rank's piece in its partition (any value when it holds none)


@dataclass(frozen=True)
class FlatGroup:
    """This rank's flat partition of one parameter group and the parameters laid in it, in order."""

    partition: torch.Tensor  # the fp32 partition the optimizer steps
    spans: tuple[FlatSpan, ...]
    group: Any  # the process group the partitions are split over
    rank: int  # this rank in ``group``
    device: torch.device  # where the pieces travel and Newton-Schulz runs (the accelerator under offload)
    param_group: int = 0  # the optimizer's parameter group this partition steps (ZeRO-3: its sub-group's group)


class FlatMuon(torch.optim.Muon):
    """``torch.optim.Muon`` stepping ZeRO's flat partitions with each matrix orthogonalized whole (module
    docstring). Built with the user's 2-D parameters; DeepSpeed then replaces each group's parameters by its
    partition."""

    def attach(self, groups: list[FlatGroup]) -> None:
        """Where each matrix lies in the partitions (the strategy calls this once the engine is built)."""
        self._flat = {id(group.partition): group for group in groups}
        self._first = id(groups[0].partition) if groups else None  # DeepSpeed steps it first in every step
        self._turns: dict[Any, int] = {}  # owners take turns over the whole step, across the groups

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:  # DeepSpeed steps one group at a time: one partition each
            for partition in group["params"]:
                if partition.grad is not None:
                    self._step_partition(partition, group)
        return loss

    def _step_partition(self, partition: torch.Tensor, group: dict[str, Any]) -> None:
        flat = getattr(self, "_flat", {}).get(id(partition))
        if flat is None:
            raise ConfigurationError(
                "FlatMuon stepped a tensor whose ZeRO layout it was not given: the ZeRO strategy calls "
                "FlatMuon.attach(...) after building DeepSpeed's engine (strategies/deepspeed/build.py follow_engine)."
            )
        if id(partition) == self._first:
            self._turns.clear()  # a new step: the first owner is rank 0 again
        update = self._momentum_update(partition, group).to(flat.device)  # one copy per partition (offload: to the GPU)
        splits = [_split(update, span, flat) for span in flat.spans]
        ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["eps"])
        orthogonal = orthogonalize_splits(splits, **ns, turns=self._turns)
        lr = float(group["lr"])  # a 1-element tensor lr too, as torch's
        partition.mul_(1 - lr * group["weight_decay"])  # elementwise: the whole partition at once (padding stays 0)
        for span, piece in zip(flat.spans, orthogonal, strict=True):
            size = span.sizes[flat.rank]
            if size == 0:
                continue
            mine = partition.narrow(0, span.offset, size)
            mine.add_(piece.to(mine.device), alpha=-adjust_lr(lr, group["adjust_lr_fn"], span.shape))

    def _momentum_update(self, partition: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """torch's momentum, elementwise on the whole partition: the buffer's lerp and the (Nesterov) update, bf16
        as Newton-Schulz casts it."""
        grad = partition.grad
        assert grad is not None
        state = self.state[partition]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(partition, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        return update.bfloat16()


def _split(update: torch.Tensor, span: FlatSpan, flat: FlatGroup) -> Split:
    local = update.narrow(0, span.offset, span.sizes[flat.rank]) if span.sizes[flat.rank] else update[:0]
    return Split(local, list(span.sizes), span.shape, flat.group)


def flat_muon_from(optimizer: torch.optim.Muon) -> FlatMuon:
    """A :class:`FlatMuon` with ``optimizer``'s parameter groups, hyper-parameters and state."""
    flat = FlatMuon([dict(group) for group in optimizer.param_groups], **optimizer.defaults)
    flat.state.update(optimizer.state)
    return flat
