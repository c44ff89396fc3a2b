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
    >>> while ft.rounds_committed < 10:
    ...     step = ft.before_inner_step()
    ...     loss_fn(model(next(batches))).backward(); inner.step(); inner.zero_grad()
    ...     ft.after_inner_step(step)
    >>> ft.shutdown()
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightscale.errors import ConfigurationError
from lightscale.parallel.diloco.outer_settings import Mode, OuterOptimizerFactory
from lightscale.parallel.diloco.outer_sync import OuterSync

REPLICA_ID_ENV = "LIGHTSCALE_REPLICA_ID"


@dataclass(frozen=True)
class FaultTolerance:
    """How a fault-tolerant DiLoCo worker meets the others (``DiLoCoStrategy(fault_tolerant=FaultTolerance(...))``).

    Args:
        replica_id: this worker's name, kept across its restarts; default: the ``LIGHTSCALE_REPLICA_ID`` variable.
        min_replicas: fewest workers a round may commit with.
        lighthouse: ``http://host:port`` of the lighthouse; default: the ``TORCHFT_LIGHTHOUSE`` variable.
        timeout_s: collectives, commits and the state transfer; a dead or hung peer costs a round at most this.
        quorum_timeout_s: how long a round's start may wait for ``min_replicas`` live workers.
        data_shards: ``None``: every worker reads its whole dataset (each worker brings its own data); ``n``: the
            dataset is split in ``n`` parts and worker ``k`` (the number ``replica_id`` ends with) reads part ``k``.
    """

    replica_id: str | None = None
    min_replicas: int = 2
    lighthouse: str | None = None
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    data_shards: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ConfigurationError(f"min_replicas={self.min_replicas!r} is not valid; use an integer >= 1.")
        for name in ("timeout_s", "quorum_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name}={getattr(self, name)!r} is not valid; use a number of seconds > 0.")
        if self.data_shards is not None and (not isinstance(self.data_shards, int) or self.data_shards < 1):
            raise ConfigurationError(f"data_shards={self.data_shards!r} is not valid; use None or an integer >= 1.")

    def resolved_replica_id(self) -> str:
        replica_id = self.replica_id or os.environ.get(REPLICA_ID_ENV)
        if not replica_id:
            raise ConfigurationError(
                f"A fault-tolerant DiLoCo worker needs a name that it keeps across restarts: pass "
                f"FaultTolerance(replica_id='worker_0') or set {REPLICA_ID_ENV}=worker_0 for each worker's launch."
            )
        return replica_id

    def data_part(self) -> int:
        """The part of the dataset this worker reads: the number its ``replica_id`` ends with."""
        replica_id = self.resolved_replica_id()
        digits = replica_id[len(replica_id.rstrip("0123456789")) :]
        assert self.data_shards is not None
        if not digits or int(digits) >= self.data_shards:
            raise ConfigurationError(
                f"replica_id={replica_id!r} does not end with a part number below data_shards={self.data_shards}; "
                f"name the workers worker_0 ... worker_{self.data_shards - 1} (or leave data_shards unset)."
            )
        return int(digits)


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
        replica_id: this worker's name; a restarted worker keeps it (torchft adds a fresh suffix).
        min_replicas: fewest workers a round may commit with.
        lighthouse_addr: ``http://127.0.0.1:PORT``; default: the ``TORCHFT_LIGHTHOUSE`` environment variable.
        mode, outer_optimizer: as for :class:`OuterSync`.
        timeout: for collectives, commits and the peer-to-peer state transfer; a dead peer costs at most this.
        quorum_timeout: how long a round's start may wait for ``min_replicas`` live workers.
        on_round: called with each :class:`RoundRecord`, this worker's payload and the mean (``None`` if dropped).
        group: this worker's own ranks (``None``: one rank); each rank holds a manager, rank 0's serves the group.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        *,
        sync_every: int,
        replica_id: str,
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
        self.manager = _build_manager(self, group, replica_id, min_replicas, lighthouse_addr, timeout, quorum_timeout)

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


def _build_manager(
    owner: FaultTolerantOuterSync,
    group: dist.ProcessGroup | None,
    replica_id: str,
    min_replicas: int,
    lighthouse_addr: str | None,
    timeout: timedelta,
    quorum_timeout: timedelta,
) -> Any:
    # optional extra: pip install lightscale[ft]
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    # The replica group's own store, served by its rank 0; torchft prefixes each quorum's keys in it.
    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    host = os.environ.get("MASTER_ADDR", "localhost") if size > 1 else "localhost"
    lighthouse = lighthouse_addr or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    local = any(name in lighthouse for name in ("127.0.0.1", "localhost"))  # peers fetch a heal from this name
    owner._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [owner._store.port if owner._store is not None else 0]
    if group is not None and size > 1:
        dist.broadcast_object_list(port, group=group, group_src=0)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=owner.load_state_dict,
        state_dict=owner.state_dict,
        min_replica_size=min_replicas,
        use_async_quorum=False,  # heal before the round's first step, so the healed worker trains the round
        timeout=timeout,
        quorum_timeout=quorum_timeout,
        rank=rank,
        world_size=size,
        store_addr=host,
        store_port=port[0],
        lighthouse_addr=lighthouse_addr,
        replica_id=replica_id,
        hostname="localhost" if local else socket.gethostname(),
    )
