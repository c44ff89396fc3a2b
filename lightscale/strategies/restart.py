"""Process groups that survive ``torchrun --max-restarts``: each attempt reads only its own rendezvous keys.

torchrun's agent hosts one key-value store for the whole job and keeps it across restarts. A restarted rank that
initializes its process group before a slower peer reads that peer's address from the previous attempt, connects
to a dead process and fails (gloo: "connectFullMesh failed ... Connection refused"), so the restart budget is spent
without training. Prefixing the store with the attempt number keeps each attempt's keys apart.

Example:
    >>> store = restart_safe_store(timedelta(minutes=10))  # None outside torchrun's agent store
    >>> dist.init_process_group("gloo", store=store, rank=rank, world_size=world) if store else ...
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def restart_safe_store(timeout: timedelta) -> dist.Store | None:
    """The agent's store, prefixed by this attempt, when torchrun's agent hosts it; else None (the default path)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # rank 0 hosts a fresh store in each attempt: nothing stale to read
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"lightscale/attempt_{attempt}", agent_store)
