"""Data parallelism whose replicas may fail and come back while the others keep training: a torchft quorum per step.

Two families run it: ``bucketed_ddp`` and the FSDP2 family (``hsdp`` across launches). Each replica (a launch of
one or more ranks) first averages its gradients over its own ranks: ``bucketed_ddp``'s bucketed reducer, or FSDP2's
reduce-scatter (lightscale/fault_tolerance/sharded_replica.py). Then rank ``r`` of every replica in this step's quorum
averages the same tensors with rank ``r`` of the others through torchft (sum over the quorum, divided by its size):
``bucketed_ddp``'s buckets and FSDP2's groups each as soon as its own average is in, while backward goes on
(:meth:`launch`; what is left once backward ran, FSDP2's 0-dimensional parameters, through :meth:`average`).
``should_commit`` gates the optimizer step: when a replica of the step failed, no survivor applies it. A replica that
(re)joins behind the others loads a live peer's state inside :meth:`FaultTolerantStep.begin` (torchft's synchronous
quorum), so it trains that step like them.

Example (each rank of each replica; ``TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510``):
    >>> step = FaultTolerantStep(FaultTolerance(replica_id="replica_0"), state_dict=..., load_state_dict=...)
    >>> step.begin(); loss_fn(model(x)).backward(); step.average(grads)  # or step.launch(bucket) during backward
    >>> if step.commit(): optimizer.step()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightscale.fault_tolerance.settings import FaultTolerance, build_manager


class QuorumTimeoutError(RuntimeError):
    """Fewer than ``min_replicas`` replicas met at the lighthouse within ``quorum_timeout_s``."""


class FaultTolerantStep:
    """One torchft ``Manager`` on this rank, driven once per optimizer step: begin, average, commit.

    Args:
        settings: replica name, ``min_replicas``, lighthouse and timeouts.
        state_dict: what a peer that heals from this replica receives (read while this rank waits in :meth:`begin`).
        load_state_dict: loads a peer's state into this replica (called inside :meth:`begin`).
        group: this replica's own ranks (``None``: one rank).
        device: this rank's device: the backend across replicas follows it (``FaultTolerance.backend``).
        manager: drive this object (torchft ``Manager``'s methods) instead of building one: the seam a unit test
            uses to fake the lighthouse and the peers (tests/unit/test_fault_tolerant_commit.py).
    """

    def __init__(
        self,
        settings: FaultTolerance,
        *,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        manager: Any = None,
    ) -> None:
        self.settings = settings
        self.open = False  # a quorum was taken and its step not committed yet
        self.participants = 0
        self.store: dist.TCPStore | None = None  # serves the manager (rank 0's): alive as long as it
        if manager is None:
            manager, self.store = build_manager(
                settings, state_dict=state_dict, load_state_dict=load_state_dict, group=group, device=device
            )
        self.manager = manager

    @property
    def committed_steps(self) -> int:
        return self.manager.current_step()

    def begin(self) -> None:
        """This step's quorum (once per step); waits up to ``quorum_timeout_s`` for ``min_replicas`` replicas."""
        if self.open:
            return
        deadline = time.monotonic() + self.settings.quorum_timeout_s
        while True:
            try:
                self.manager.start_quorum()
            except Exception as error:  # torchft's own timeout names neither the setting nor the remedy
                raise self._timeout_error() from error
            self.participants = self.manager.num_participants()
            if self.participants >= self.settings.min_replicas:
                break
            if time.monotonic() > deadline:
                raise self._timeout_error()
            time.sleep(0.1)  # a quorum smaller than min_replicas commits nothing: ask again
        self.open = True

    @torch.no_grad()
    def launch(self, tensor: Tensor) -> Any:
        """Start averaging ``tensor`` in place over this step's replicas; the work's ``wait()`` never raises (an error
        is recorded by the manager: :meth:`commit` answers False)."""
        return self.manager.allreduce(tensor)

    def average(self, tensors: Iterable[Tensor]) -> None:
        """Average ``tensors`` in place over this step's replicas (all launched, then all waited on)."""
        works = [self.launch(tensor) for tensor in tensors]
        for work in works:
            work.wait()

    def commit(self) -> bool:
        """Whether every replica of the step succeeded: the optimizer steps only then (the same answer everywhere)."""
        self.open = False
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _timeout_error(self) -> QuorumTimeoutError:
        s = self.settings
        return QuorumTimeoutError(
            f"lightscale-ft: fewer than min_replicas={s.min_replicas} replicas met at the lighthouse "
            f"{s.resolved_lighthouse()} within quorum_timeout_s={s.quorum_timeout_s} (this step had "
            f"{self.participants}). Start the other replicas, or lower min_replicas (the lighthouse's --min-replicas "
            f"too)."
        )
