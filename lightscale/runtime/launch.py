"""Ranks that live and die with their launcher.

**Restarts.** torchrun's agent hosts one key-value store for the whole job and keeps it across restarts. A
restarted rank that initializes its process group before a slower peer reads that peer's address from the previous
attempt, connects to a dead process and fails (gloo: "connectFullMesh failed ... Connection refused"), so the
restart budget is spent without training. Prefixing the store with the attempt number keeps each attempt's keys apart.

**Orphans.** A rank started by a launcher (Lightning's rank 0, torchrun's agent) that dies abruptly would wait for
the dead launcher's store until its timeout. The kernel ends such a rank when its launcher exits (Linux
``PR_SET_PDEATHSIG``); a rank whose launcher died before that call took effect notices the changed parent and ends.

Example:
    >>> exit_with_launcher()                               # in every rank, before the process group
    >>> store = restart_safe_store(timedelta(minutes=10))  # None outside torchrun's agent store
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightscale.patches.process import set_environment, unset_environment


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


_PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_PID = "LIGHTSCALE_LAUNCHER_PID"  # set only in the environment of the ranks Lightning's launcher starts


class Launcher(_SubprocessScriptLauncher):
    """Lightning's launcher (rank 0 starts the other ranks), telling the ranks it starts who their launcher is.

    ``launch`` first runs the strategy's ``check_before_launch(trainer)``: the first point where the Trainer's
    settings meet the strategy's, before any process starts (or, launched by torchrun, before any collective).
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        check = getattr(getattr(trainer, "strategy", None), "check_before_launch", None)
        if check is not None:
            check(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        set_environment({LAUNCHER_PID: str(os.getpid())})
        try:
            super()._call_children_scripts()
        finally:
            unset_environment([LAUNCHER_PID])  # this process and later subprocesses are not its children


def _launcher_pid() -> int | None:
    if LAUNCHER_PID in os.environ:
        return int(os.environ[LAUNCHER_PID])
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return os.getppid()  # torchrun's agent
    return None  # started by a user, a test harness or a scheduler: nothing to follow


def exit_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when its launcher exits; a no-op for unlaunched processes and off Linux."""
    launcher = _launcher_pid()
    if launcher is None or not sys.platform.startswith("linux"):
        return
    # SIGKILL, not SIGTERM: a rank blocked in a C++ store call would not run a Python handler until it returns.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher:
        raise RuntimeError(f"lightscale: this rank's launcher (pid {launcher}) exited during start-up; ending.")


def free_port() -> int:
    """A free TCP port on loopback (for a rendezvous or a lighthouse started on this machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
