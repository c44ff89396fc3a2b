"""The processes under every lightscale strategy, on Lightning's ``ParallelStrategy``: devices and ranks, the launcher,
the process group (gloo on CPU, nccl on CUDA) with a collective timeout so a hang fails fast, the failure watcher
that tells every rank when one raises, and the collectives Lightning calls (barrier, broadcast, reduce).

:class:`~lightscale.strategies.base.LightscaleStrategy` is the one class on it (the layout, the model, checkpoints
through the Checkpointer it owns, the step). These stay apart from it because Lightning calls each on the strategy by
name and none holds a lightscale decision: the plumbing under the base, not a layer of it.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.connectors import checkpoint_connector as _checkpoint_connector
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightscale.errors import ConfigurationError
from lightscale.patches.process import set_rank_zero_rank
from lightscale.runtime.barrier import barrier
from lightscale.runtime.failure import is_timeout, record_failure, watch_for_failures
from lightscale.runtime.flight_recorder import maybe_enable_flight_recorder
from lightscale.runtime.launch import Launcher, exit_with_launcher, restart_safe_store

# A collective that waits this long is a hang: errors reach every rank through the failure watcher within seconds,
# and the slow single-rank phases (prepare_data) wait at Lightning's own barrier, which has no timeout. Ten
# minutes is torch's NCCL default and covers a first-step compile or a large checkpoint write; raise it with
# ``timeout_s`` for slower ones.
DEFAULT_TIMEOUT_S = 600.0


# Lightning's checkpoint connector restores in these methods (and those they call): a failure below one of them
# happened while restoring, though Lightning has already set the stage (and step 0) of the run to come.
RESTORING = ("resume_start", "restore", "_restore_modules_and_callbacks", "restore_training_state", "resume_end")


def raised_while_restoring(error: BaseException) -> bool:
    """``error`` was raised below Lightning's checkpoint restore (``fit(ckpt_path=...)``, ``validate(ckpt_path=...)``):
    its traceback passes through one of the :data:`RESTORING` methods of Lightning's checkpoint connector."""
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name in RESTORING and tb.tb_frame.f_globals.get("__name__") == _checkpoint_connector.__name__:
            return True
        tb = tb.tb_next
    return False


def _phase(trainer: Any | None, error: BaseException) -> str:
    """Where the run was when ``error`` was raised: "fit, step 12"; "fit, restoring the checkpoint PATH" below
    Lightning's restore, where the trainer already shows the stage to come at step 0; "start-up" before fit attached
    the module (``trainer`` None: asking for it then would raise "not attached")."""
    if trainer is None:
        return "start-up"
    if raised_while_restoring(error):
        return f"{trainer.state.fn.value}, restoring the checkpoint {trainer.ckpt_path}"
    stage = trainer.state.stage.value if trainer.state.stage else "start-up"
    return f"{stage}, step {trainer.global_step}"


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessStrategy(ParallelStrategy):
    """Ranks, process group and collectives; ``timeout_s`` bounds every collective (seconds, ``self.timeout``)."""

    def __init__(
        self,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if not timeout_s > 0:
            raise ConfigurationError(
                f"timeout_s={timeout_s!r} is not valid: the collective timeout must be positive seconds."
            )
        self._num_nodes = 1
        self._backend = process_group_backend
        self.timeout = timedelta(seconds=timeout_s)
        self._trace_prefix: str | None = None  # NCCL flight recorder files (rank appended), when one runs

    # ---- devices and processes ---------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this to decide metric syncing and distributed samplers.
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str:
        return self._backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._launcher = Launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        exit_with_launcher()  # else a rank whose launcher died waits for the launcher's store until the timeout
        if not dist.is_initialized():
            self._trace_prefix = maybe_enable_flight_recorder(self.process_group_backend, self._run_dir())
            store = restart_safe_store(self.timeout)
            kwargs: dict[str, Any] = {"store": store} if store is not None else {}
            if self.root_device.type != "cpu":  # NCCL binds the group to this rank's device, as Lightning's ddp does
                kwargs["device_id"] = self.root_device
            _init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self.timeout, **kwargs)
            # Destroyed at exit, not in teardown: Lightning calls on_fit_end and later fit()/test() after teardown.
            atexit.register(_destroy_process_group)
        watch_for_failures(self.global_rank)

    def _run_dir(self) -> Path:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return Path(trainer.default_root_dir if trainer is not None else os.getcwd())

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        set_rank_zero_rank(self.global_rank)

    # ---- collectives ---------------------------------------------------------------------------------------
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, DTensor):
            # A value computed from sharded parameters or gradients (``self.log("grad_norm", p.grad.norm(),
            # sync_dist=True)`` under FSDP2 or tensor parallelism): its whole value on every rank, as one process has
            # it, then reduced like any other (c10d has no rule for a DTensor).
            tensor = tensor.full_tensor()
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Recorded, not yet announced: the script may handle it on every rank (lightscale/runtime/failure.py).
        record_failure(self.global_rank, exception, where=self._failure_context(exception))

    def _failure_context(self, exception: BaseException) -> str:
        # _trainer: an error raised before fit attached the module (at launch) must not turn into "not attached".
        where = _phase(getattr(self.lightning_module, "_trainer", None), exception)
        if is_timeout(exception):
            where += f"; a collective timed out after {self.timeout.total_seconds():.0f} s: a rank that did not arrive"
            where += " prints where it was"
            if self._trace_prefix is not None:
                where += f"; NCCL flight recorder traces of every rank: {self._trace_prefix}<rank>"
        return where
