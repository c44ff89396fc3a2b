"""DiLoCo whose workers may fail and come back without stopping the job, through torchft.

Each worker (a replica group of one or more ranks: ``group``, the worker's own process group) holds one torchft
``Manager`` per rank; rank ``r`` of every worker averages with rank ``r`` of the others (its shard of the model
under FSDP2, the whole model under bucketed data parallelism). At the first inner step of each round
the workers alive at that moment form a quorum at the lighthouse (:mod:`.lighthouse`); a worker behind the others
(restarted, or whose last round failed) receives the global parameters, the outer optimizer state and the step
from a live peer right there, then trains the round like the others. At the round's end the pseudo-gradients are
summed over the quorum and divided by its size, so each worker of the round counts once; ``should_commit`` gates
the outer step: if any worker of the round failed, every survivor drops the round (back to the global parameters)
and the next round goes on with whoever is alive.

Example (each worker process; ``TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510``):
    >>> ft = FaultTolerantOuterSync(model.named_parameters(), sync_every=4, replica_id="worker_0")
    >>> ft = FaultTolerantOuterSync(model.named_parameters(), sync_every=4, settings=FaultTolerance(...))  # the same
    >>> while ft.rounds_committed < 10:
    ...     step = ft.before_inner_step()
    ...     loss_fn(model(next(batches))).backward(); inner.step(); inner.zero_grad()
    ...     ft.after_inner_step(step)
    >>> ft.shutdown()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightscale.fault_tolerance.settings import REPLICA_ID_ENV, FaultTolerance, build_manager
from lightscale.parallel.diloco.outer_settings import Mode, OuterOptimizerFactory
from lightscale.parallel.diloco.outer_sync import OuterSync

__all__ = ["REPLICA_ID_ENV", "FaultTolerance", "FaultTolerantOuterSync", "RoundRecord"]  # FaultTolerance: re-exported


@dataclass(frozen=True)
class RoundRecord:
    """One worker's view of one outer sync: who took part and what went in and out (as checksums)."""

    round: int  # rounds committed before this one: the same number on every worker of the round
    step: int  # inner steps done
    participants: int  # workers in the quorum: the divisor of the mean
    committed: bool  # False: some worker of the round failed; no outer step was taken
    contribution: float  # checksum of this worker's pseudo-gradient
    mean: float  # checksum of the mean it received (nan when not committed)


def checksum(flat: Tensor) -> float:
    """Position-weighted sum in float64: linear, so the mean's checksum is the mean of the contributions'."""
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return float((flat.detach().double().reshape(-1) * weights).sum())


class FaultTolerantOuterSync:
    """:class:`OuterSync` (one fragment, no overlap, fp32) whose outer average goes through a torchft ``Manager``.

    Args:
        named_parameters: ``(name, tensor)`` pairs of this worker's model.
        sync_every: ``H``, inner steps per round.
        settings: the worker's :class:`FaultTolerance` (name, ``min_replicas``, lighthouse, timeouts, backend), as
            ``DiLoCoStrategy(fault_tolerant=...)`` passes it; or, without it, these few of its fields:
        replica_id: this worker's name; a restarted worker keeps it (torchft adds a fresh suffix).
        min_replicas: fewest workers a round may commit with.
        lighthouse_addr: ``http://127.0.0.1:PORT``; default: the ``TORCHFT_LIGHTHOUSE`` environment variable.
        timeout: for collectives, commits and the peer-to-peer state transfer; a dead peer costs at most this.
        quorum_timeout: how long a round's start may wait for ``min_replicas`` live workers.
        mode, outer_optimizer: as for :class:`OuterSync`.
        on_round: called with each :class:`RoundRecord`, this worker's payload and the mean (``None`` if dropped).
        group: this worker's own ranks (``None``: one rank); each rank holds a manager, rank 0's serves the group.

    The backend across workers follows the parameters' device (``FaultTolerance.backend`` overrides it).
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        *,
        sync_every: int,
        settings: FaultTolerance | None = None,
        replica_id: str | None = None,
        min_replicas: int = 2,
        lighthouse_addr: str | None = None,
        mode: Mode = "diloco",
        outer_optimizer: OuterOptimizerFactory | None = None,
        timeout: timedelta = timedelta(seconds=30),
        quorum_timeout: timedelta = timedelta(seconds=60),
        on_round: Callable[[RoundRecord, Tensor, Tensor | None], None] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.sync = OuterSync(
            named_parameters, sync_every=sync_every, mode=mode, outer_optimizer=outer_optimizer, reduce=self._average
        )
        self.on_round = on_round
        self.history: list[RoundRecord] = []
        self.heals = 0  # times this worker received the state from a peer
        self._round_open = False
        if settings is None:
            settings = FaultTolerance(
                replica_id=replica_id,
                min_replicas=min_replicas,
                lighthouse=lighthouse_addr,
                timeout_s=timeout.total_seconds(),
                quorum_timeout_s=quorum_timeout.total_seconds(),
            )
        self.settings = settings
        device = self.sync.local(0).device if self.sync.names else torch.device("cpu")
        # Synchronous quorum: a worker behind heals before the round's first step, so it trains the round.
        self.manager, self.store = build_manager(
            settings, state_dict=self.state_dict, load_state_dict=self.load_state_dict, group=group, device=device
        )  # the store (rank 0's) serves the manager: kept here as long as it

    @property
    def step(self) -> int:
        """Inner steps done (jumps to the peers' count when this worker heals)."""
        return self.sync.step

    @property
    def rounds_committed(self) -> int:
        return self.manager.current_step()

    def before_inner_step(self) -> int:
        """Call before every inner step; returns that step's number. A round's first step waits for its quorum."""
        if not self._round_open:
            self.manager.start_quorum()  # synchronous: a healing worker has loaded the peer's state on return
            self._round_open = True
        return self.sync.step + 1

    def after_inner_step(self, step: int) -> None:
        """Call after inner step ``step``; at a round's last step this averages over the round's workers."""
        self.sync.after_inner_step(step)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    @torch.no_grad()
    def _average(self, payload: Tensor) -> Tensor | None:
        self._round_open = False
        round_, contribution = self.manager.current_step(), payload.clone()
        self.manager.allreduce(payload).wait()  # sums over the quorum and divides by its size; errors are recorded
        committed = self.manager.should_commit()  # False on every survivor if any worker of the round failed
        mean = payload if committed else None
        record = RoundRecord(
            round=round_,
            step=self.sync.step,
            participants=self.manager.num_participants(),
            committed=committed,
            contribution=checksum(contribution),
            mean=checksum(payload) if committed else math.nan,
        )
        self.history.append(record)
        if self.on_round is not None:
            self.on_round(record, contribution, mean)
        return mean

    def state_dict(self) -> dict[str, Any]:
        """What a healing worker receives: the outer state (global parameters, outer optimizer) and the parameters."""
        # Copies of this rank's local values (shards under FSDP2): torchft's HTTP transport serves this dict when the
        # peer asks, after this worker trained on; the peer's rank of the same position receives it.
        params = {name: self.sync.local(i).clone() for i, name in enumerate(self.sync.names)}
        return {"outer": self.sync.state_dict(), "params": params}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sync.load_state_dict(state["outer"])
        for i, name in enumerate(self.sync.names):
            self.sync.local(i).copy_(state["params"][name])
        self.heals += 1
