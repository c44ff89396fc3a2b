"""How a replica group meets the others through torchft: :class:`FaultTolerance` (the settings every fault-tolerant
strategy takes) and :func:`build_manager` (one torchft ``Manager`` per rank, served by the group's own store).

Two features use them: fault-tolerant DiLoCo (a quorum per round, lightscale/fault_tolerance/diloco.py) and
per-step fault tolerance of ``bucketed_ddp`` and the FSDP2 family (``hsdp`` across launches; a quorum per optimizer
step, lightscale/fault_tolerance/step.py). :func:`fault_tolerance_of` reads every strategy's ``fault_tolerant=``.

Example:
    >>> ft = FaultTolerance(replica_id="replica_0", min_replicas=1, lighthouse="http://127.0.0.1:29510")
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightscale.errors import ConfigurationError

REPLICA_ID_ENV = "LIGHTSCALE_REPLICA_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
BACKENDS = (None, "gloo", "nccl")  # None: by the device (gloo on CPU, nccl on CUDA)


@dataclass(frozen=True)
class FaultTolerance:
    """How a replica group (one launch: a DiLoCo worker, a ``bucketed_ddp`` or FSDP2-family replica) meets the others.

    Args:
        replica_id: this replica's name, kept across its restarts; default: the ``LIGHTSCALE_REPLICA_ID`` variable.
        min_replicas: fewest replicas a step (DiLoCo: a round) may commit with.
        lighthouse: ``http://host:port`` of the lighthouse; default: the ``TORCHFT_LIGHTHOUSE`` variable.
        timeout_s: collectives, commits and the state transfer; a dead or hung peer costs a step at most this.
        quorum_timeout_s: how long a step's (round's) start may wait for ``min_replicas`` live replicas.
        data_shards: ``None``: every replica reads its whole dataset (each brings its own data); ``n``: the
            dataset is split in ``n`` parts and replica ``k`` (the number ``replica_id`` ends with) reads part ``k``.
        backend: the collectives across replicas: ``None`` (by the device: gloo on CPU, nccl on CUDA), ``"gloo"``
            or ``"nccl"``.
    """

    replica_id: str | None = None
    min_replicas: int = 2
    lighthouse: str | None = None
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    data_shards: int | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise ConfigurationError(f"min_replicas={self.min_replicas!r} is not valid; use an integer >= 1.")
        for name in ("timeout_s", "quorum_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigurationError(f"{name}={getattr(self, name)!r} is not valid; use a number of seconds > 0.")
        if self.data_shards is not None and (not isinstance(self.data_shards, int) or self.data_shards < 1):
            raise ConfigurationError(f"data_shards={self.data_shards!r} is not valid; use None or an integer >= 1.")
        if self.backend not in BACKENDS:
            raise ConfigurationError(
                f"backend={self.backend!r} is not valid; use None (by the device: gloo on CPU, nccl on CUDA), "
                f"'gloo' or 'nccl'."
            )

    @property
    def timeout(self) -> timedelta:
        """``timeout_s`` as torchft takes it (collectives, commits, the state transfer)."""
        return timedelta(seconds=self.timeout_s)

    @property
    def quorum_timeout(self) -> timedelta:
        """``quorum_timeout_s`` as torchft takes it."""
        return timedelta(seconds=self.quorum_timeout_s)

    def backend_for(self, device: torch.device | str) -> str:
        """The backend of the collectives across replicas on ``device``: ``backend``, else gloo on CPU, nccl on CUDA."""
        return choose_backend(self.backend, torch.device(device))

    def resolved_replica_id(self) -> str:
        replica_id = self.replica_id or os.environ.get(REPLICA_ID_ENV)
        if not replica_id:
            raise ConfigurationError(
                f"A fault-tolerant replica (a DiLoCo worker, a bucketed_ddp replica) needs a name that it keeps across "
                f"restarts: pass FaultTolerance(replica_id='worker_0') or set {REPLICA_ID_ENV}=worker_0 for each "
                f"replica's launch."
            )
        return replica_id

    def resolved_lighthouse(self) -> str:
        lighthouse = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse.startswith(("http://", "https://")):
            raise ConfigurationError(
                f"lighthouse={self.lighthouse!r} ({LIGHTHOUSE_ENV}={os.environ.get(LIGHTHOUSE_ENV)!r}) is not an "
                f"address: pass FaultTolerance(lighthouse='http://127.0.0.1:29510') or set {LIGHTHOUSE_ENV}, after "
                f"starting one with `python -m lightscale.fault_tolerance.lighthouse --min-replicas 1 --port 29510`."
            )
        return lighthouse

    def data_part(self) -> int:
        """The part of the dataset this replica reads: the number its ``replica_id`` ends with."""
        replica_id = self.resolved_replica_id()
        digits = replica_id[len(replica_id.rstrip("0123456789")) :]
        assert self.data_shards is not None
        if not digits or int(digits) >= self.data_shards:
            raise ConfigurationError(
                f"replica_id={replica_id!r} does not end with a part number below data_shards={self.data_shards}; "
                f"name the workers worker_0 ... worker_{self.data_shards - 1} (or leave data_shards unset)."
            )
        return int(digits)


def choose_backend(backend: str | None, device: torch.device) -> str:
    """``backend`` when set, else by the device: nccl on CUDA, gloo on CPU (and anything else)."""
    if backend not in BACKENDS:
        raise ConfigurationError(f"backend={backend!r} is not valid; use None, 'gloo' or 'nccl'.")
    return backend or ("nccl" if device.type == "cuda" else "gloo")


def fault_tolerance_of(fault_tolerant: FaultTolerance | bool | None, feature: str) -> FaultTolerance | None:
    """The settings of a strategy's ``fault_tolerant=`` (``None`` when off), refused before any process starts where
    the value is not one, or torchft is missing; each feature adds its own refusals (replica.py, diloco_worker.py)."""
    if fault_tolerant is None or fault_tolerant is False:
        return None
    ft = FaultTolerance() if fault_tolerant is True else fault_tolerant
    if not isinstance(ft, FaultTolerance):
        raise ConfigurationError(
            f"fault_tolerant={fault_tolerant!r} is not valid; use True, False or FaultTolerance(replica_id=..., ...)."
        )
    require_torchft(feature)
    return ft


def require_torchft(feature: str) -> None:
    """Refuse before any process starts where the ``[ft]`` extra is missing."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigurationError(f"{feature} runs on torchft, not installed: pip install 'lightscale[ft]'.")


def build_manager(
    settings: FaultTolerance,
    *,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], None],
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
) -> tuple[Any, dist.TCPStore | None]:
    """A torchft ``Manager`` for this rank (rank ``r`` of the replica averages with rank ``r`` of the others) and the
    replica group's store that serves it (rank 0's; ``None`` elsewhere): the caller, which owns the manager, keeps
    the store alive as long as the manager.

    The quorum is synchronous (a replica behind its peers loads their state before ``start_quorum`` returns, so it
    trains the step like them). The collectives across replicas run on ``settings.backend_for(device)``.
    """
    from torchft.manager import Manager  # optional extra: pip install lightscale[ft]
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    process_group = {"gloo": ProcessGroupGloo, "nccl": ProcessGroupNCCL}[settings.backend_for(device)]
    rank, size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    host = os.environ.get("MASTER_ADDR", "localhost") if size > 1 else "localhost"
    lighthouse = settings.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    local = any(name in lighthouse for name in ("127.0.0.1", "localhost"))  # peers fetch a heal from this name
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    if group is not None and size > 1:
        dist.broadcast_object_list(port, group=group, group_src=0)
    manager = Manager(
        pg=process_group(timeout=settings.timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=settings.min_replicas,
        use_async_quorum=False,
        timeout=settings.timeout,
        quorum_timeout=settings.quorum_timeout,
        rank=rank,
        world_size=size,
        store_addr=host,
        store_port=port[0],
        lighthouse_addr=settings.lighthouse,
        replica_id=settings.resolved_replica_id(),
        hostname="localhost" if local else socket.gethostname(),
    )
    return manager, store
