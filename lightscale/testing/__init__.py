"""Run a function on N ``gloo`` ranks inside one Python process (pytest, a benchmark) with a hard timeout.

Forked children start in milliseconds and inherit the parent's imports. Each child gets one OpenMP thread
(an OpenMP pool does not survive ``fork``), the torchrun environment variables (so Lightning treats the
processes as launched externally and never re-runs the command) and a process group whose collectives time
out, so a bug fails fast instead of hanging CI.

Example:
    >>> def world(): return torch.distributed.get_world_size()
    >>> run_distributed(world, world_size=2)
    [2, 2]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightscale.patches.process import set_environment
from lightscale.runtime.failure import EXIT_CODE, report_escaped, settle_failures
from lightscale.runtime.launch import free_port


class RankFailed(RuntimeError):
    """A rank raised; the message carries its traceback."""


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    timeout_s: float = 180.0,
    collective_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` forked ranks; return the per-rank results in rank order.

    A rank that another rank's announced failure ended (exit code ``EXIT_CODE``) before it reported gives ``None``,
    once every other rank has reported (e.g. all ranks meet the same error and the slower ones are ended by the
    first one's announcement while the test catches it on the first)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, collective_timeout_s, fn, args, kwargs, results),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(results, procs, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


def _collect(results: Any, procs: list[Any], timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    outcome: dict[int, tuple[str, Any]] = {}
    while len(outcome) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(outcome))
            raise TimeoutError(f"Ranks {missing} did not finish within {timeout_s:.0f} s (a hang or a deadlock).")
        try:
            rank, status, value = results.get(timeout=min(remaining, 1.0))
        except Exception:  # queue.Empty: check for ranks that died without reporting
            _raise_if_died(procs, outcome, results)
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} failed:\n{value}")
        outcome[rank] = (status, value)
    return [None if outcome[rank] == _ENDED else pickle.loads(outcome[rank][1]) for rank in range(len(procs))]


_ENDED = ("ended", b"")  # ended by another rank's announced failure, before reporting


def _raise_if_died(procs: list[Any], outcome: dict[int, Any], results: Any) -> None:
    if not results.empty():  # a rank writes its report before it exits: read what arrived since the last look
        return
    for rank, proc in enumerate(procs):
        if rank not in outcome and not proc.is_alive() and proc.exitcode not in (None, 0, EXIT_CODE):
            raise RankFailed(f"rank {rank} died with exit code {proc.exitcode} before reporting a result.")
    # Ranks ended by another rank's announced failure wait for that rank's report, unless nobody is left to send it.
    unfinished = [rank for rank in range(len(procs)) if rank not in outcome]
    if all(not procs[rank].is_alive() for rank in unfinished):
        if outcome and all(procs[rank].exitcode == EXIT_CODE for rank in unfinished):
            outcome.update(dict.fromkeys(unfinished, _ENDED))
            return
        raise RankFailed(
            f"every unfinished rank ended without reporting a result (exit codes {[proc.exitcode for proc in procs]})."
        )


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    collective_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
) -> None:
    set_environment(
        dict(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0",
            OMP_NUM_THREADS="1",
        )
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout_s)
        )
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with this process.
        results.put((rank, "ok", pickle.dumps(fn(*args, **kwargs))))
    except BaseException as error:
        report_escaped(rank, error)  # escapes the rank's program: the ranks waiting for it are told
        results.put((rank, "error", traceback.format_exc()))
    finally:
        settle_failures()  # a failure ``fn`` handled while another rank waits for it (os._exit skips atexit)
        if dist.is_initialized():
            dist.destroy_process_group()
        results.close()
        results.join_thread()
        os._exit(0)  # skip the parent's atexit handlers (pytest's among them)


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KillAt(pl.Callback):
    """One SIGKILL per torchrun attempt: in attempt ``i``, after optimizer step ``steps[i]`` on ``rank``.

    A step also listed in ``in_save`` is killed *during* the checkpoint save at that step instead: an entry added
    to the checkpoint kills whichever rank serializes it (rank 0 for single files and trainer state), when the
    save has opened its files and sharded ones have written their shards. Before dying, that rank writes
    ``report_dir/kill_<attempt>.json`` with the checkpoint directory's entries at that moment. Attempts past the
    list run untouched, so ``steps=[3, 6, 9]`` under ``--max-restarts 3`` ends in a complete run.
    """

    def __init__(
        self, steps: list[int], rank: int = 1, in_save: list[int] | None = None, report_dir: str = "."
    ) -> None:
        self.steps, self.rank, self.in_save, self.report_dir = list(steps), rank, list(in_save or []), report_dir

    def _due(self, trainer: pl.Trainer) -> int | None:
        attempt = _attempt()
        due = attempt < len(self.steps) and trainer.global_step == self.steps[attempt]
        return self.steps[attempt] if due else None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = self._due(trainer)
        if step is not None and step not in self.in_save and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        step = self._due(trainer)
        if step is not None and step in self.in_save:
            watched = getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
            report = Path(self.report_dir) / f"kill_{_attempt()}.json"
            checkpoint["lightscale_kill_when_serialized"] = _KillWhenSerialized(str(watched), str(report))


class _KillWhenSerialized:
    """Pickling this object records what ``watched`` holds, then SIGKILLs the process doing the pickling."""

    def __init__(self, watched: str, report: str) -> None:
        self.watched, self.report = watched, report

    def __reduce__(self) -> Any:
        root = Path(self.watched)
        entries = sorted(str(path.relative_to(root)) for path in root.rglob("*"))
        Path(self.report).write_text(json.dumps({"rank": int(os.environ.get("RANK", 0)), "entries": entries}))
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")


def torchrun_fork(entrypoint: Callable[..., Any], *args: Any, nproc: int, max_restarts: int) -> dict[int, Any]:
    """``torchrun --standalone --nproc-per-node N --max-restarts R`` with a Python function as the entrypoint.

    The same argument parsing, elastic agent, rendezvous and restart logic as the command line; only the workers
    are forked from this process (``--start-method fork``) instead of started as new interpreters, so a restart
    costs milliseconds instead of seconds of imports. Returns each rank's return value of the last attempt.
    """
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    flags = ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "--start-method", "fork"]
    parsed = parse_args([*flags, "--monitor-interval", "0.1", "unused-script"])
    # What torchrun's --standalone sets: a c10d rendezvous on a free local port.
    parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(parsed)
    return elastic_launch(config, entrypoint)(*args)
