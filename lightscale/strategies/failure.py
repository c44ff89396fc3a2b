"""When one rank raises, every rank stops within seconds and says which rank failed and why.

Without this, the other ranks wait inside their next collective until its timeout (NCCL does not notice a dead
peer; gloo does, but reports only "Connection closed by peer"). The failing rank writes its error into the
process group's key-value store (Lightning calls ``Strategy.on_exception``); a daemon thread on every rank polls
that key and, when another rank's error appears, prints it and ends this process.

Example:
    >>> watch_for_failures(rank)          # once per process, after the process group exists
    >>> announce_failure(rank, error)     # on the rank that raised, before it unwinds
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch.distributed as dist

FAILURE_KEY = "lightscale/failure"
EXIT_CODE = 75  # "ended because another rank failed": tells a harness this is not the root cause
_watching: set[int] = set()


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group (e.g. destroyed), or a store-less backend
        return None


def announce_failure(rank: int, error: BaseException) -> None:
    """Publish ``rank``'s error so every other rank stops (best effort: never masks the error itself)."""
    store = _store()
    if store is None:
        return
    # The store may be gone (rank 0 died first): the error still propagates on this rank.
    with contextlib.suppress(Exception):
        store.set(FAILURE_KEY, f"rank {rank} raised {type(error).__name__}: {error}".encode())


def watch_for_failures(rank: int, *, interval_s: float = 0.5) -> None:
    """Start (once per process) the thread that ends this rank when another rank announces a failure."""
    store = _store()
    if store is None or os.getpid() in _watching:
        return
    _watching.add(os.getpid())
    thread = threading.Thread(target=_watch, args=(store, rank, interval_s), name="lightscale-failure-watch")
    thread.daemon = True
    thread.start()


def _watch(store: dist.Store, rank: int, interval_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval_s):
        try:
            if not store.check([FAILURE_KEY]):
                continue
            message = store.get(FAILURE_KEY).decode()
        except Exception:  # the store went away (normal shutdown of rank 0): nothing left to watch
            return
        if message.startswith(f"rank {rank} "):
            return  # our own failure: this rank is already unwinding with the real traceback
        print(f"lightscale: ending rank {rank} because {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)
