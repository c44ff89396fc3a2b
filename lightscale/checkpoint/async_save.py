"""Checkpoint saves that write in the background while training goes on, published atomically as before.

``save`` blocks only while the state is copied to CPU memory (``torch.distributed.checkpoint.async_save``'s
stager); DCP then writes the shards from a side thread, and when every rank's shards and ``.metadata`` are on
disk, rank 0 writes ``trainer_state.pt`` into the staging directory and renames it into place
(lightscale/storage/atomic_dir.py): a checkpoint is never visible half-written, and a run killed mid-write keeps
the previous one.

Why a second process group: DCP's save gathers plans and results with collectives. Issued from a side thread on
the training process group they would interleave with training's own collectives (gloo matches them by order, so
they mismatch or deadlock); a gloo group created for checkpoints (collectively, on the first async save) keeps the
two streams apart. It is gloo even on GPUs: the staged copy lives in CPU memory.

At most one save is in flight: the next save, ``wait()``, and strategy teardown wait for the previous one, and
re-raise its error if it failed.

Example:
    >>> writer = AsyncCheckpointWriter()
    >>> writer.save(Path("last.ckpt"), {"model": model_state, "optimizer": optim_state}, rest, save_file)
    >>> ...  # training continues
    >>> writer.wait()  # last.ckpt is published on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightscale.storage.atomic_dir import agreed_staging, publish
from lightscale.storage.urls import storage_writer


class AsyncCheckpointWriter:
    """Writes :func:`~lightscale.checkpoint.portable.write_checkpoint`'s layout in the background."""

    def __init__(self, *, timeout: timedelta | None = None) -> None:
        self._timeout = timeout
        self._group: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._stager = _CPUCopyStager()

    def save(self, path: Path, state: dict[str, Any], write_rest: Callable[[Path], None] | None) -> None:
        """Collectively start writing ``state`` with DCP as directory ``path``; return once it is staged in CPU
        memory. ``write_rest(staging_dir)`` (rank 0 only; ``None`` elsewhere) adds the other files before the
        publish; it must not read live training objects (pass it copies)."""
        self.wait()
        rank = dist.get_rank() if dist.is_initialized() else 0
        staging = agreed_staging(path)  # the training group, from the training thread: nobody writes before clean-up
        upload = dcp.async_save(
            state, storage_writer=storage_writer(staging), process_group=self._side_group(), async_stager=self._stager
        )
        self._pending = self._thread().submit(self._publish, upload, staging, path, rank == 0, write_rest)

    def _publish(
        self, upload: Future, staging: Path, path: Path, publisher: bool, write_rest: Callable[[Path], None] | None
    ) -> None:
        upload.result()  # on every rank: all shards and .metadata are written (DCP gathers the results to rank 0)
        if publisher:
            if write_rest is not None:
                write_rest(staging)
            publish(staging, path)
        if self._group is not None:
            dist.barrier(group=self._group)  # every rank's wait() returns after the rename

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight and stop the side thread (the process group lives until the process ends)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightscale-async-save")
        return self._executor

    def _side_group(self) -> Any:
        """The checkpoint process group, created on first use (every rank is in ``save``: a collective point)."""
        if self._group is None and dist.is_initialized():
            kwargs = {"timeout": self._timeout} if self._timeout is not None else {}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group


class _CPUCopyStager(AsyncStager):
    """Stages by copying every tensor to CPU memory in the caller, into the previous save's buffers when their
    shape, dtype and placements match (that save is finished: :meth:`AsyncCheckpointWriter.save` waits first).

    torch's ``DefaultStager`` deep-copies the state dict through a generic memo-based traversal into fresh memory;
    a plain copy into reused buffers does the same job in a fraction of the time, which is the time training is
    blocked. Non-tensor entries (numbers, strings) are kept as they are; containers are rebuilt.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    @override
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._copy(state_dict, "")

    def _copy(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            source = value.detach()
            buffer = self._buffers.get(key)
            if buffer is None or not _same_layout(buffer, source):
                buffer = self._buffers[key] = source.to("cpu", copy=True)
            else:
                buffer.copy_(source)
            return buffer
        if isinstance(value, dict):
            return {name: self._copy(item, f"{key}/{name}") for name, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, f"{key}/{index}") for index, item in enumerate(value))
        return value

    @override
    def synchronize_staging(self) -> None:
        pass

    @override
    def close(self) -> None:
        pass  # the buffers are kept for the next save


def _same_layout(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    if (buffer.shape, buffer.dtype, type(buffer)) != (source.shape, source.dtype, type(source)):
        return False
    if isinstance(source, DTensor):
        return (buffer.placements, buffer.to_local().shape) == (source.placements, source.to_local().shape)
    return True
