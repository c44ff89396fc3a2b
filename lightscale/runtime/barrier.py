"""One barrier for every lightscale rank: NCCL told which device this rank uses, so it never guesses.

A bare ``dist.barrier()`` under NCCL without a bound device makes torch guess the device from the rank (and warn), which
is wrong when ranks and devices are not numbered alike; gloo needs nothing. Lightning's own ddp passes ``device_ids``
the same way. The process group itself is created with ``device_id`` (runtime/processes.py) for the same reason.

Example:
    >>> barrier()  # no-op without a process group
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
