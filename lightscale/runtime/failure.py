"""When one rank raises, every rank stops within seconds and says which rank failed and why.

Without this, the other ranks wait inside their next collective until its timeout (NCCL does not notice a dead
peer; gloo does, but reports only "Connection closed by peer"). The failing rank writes its error into the
process group's key-value store (Lightning calls ``Strategy.on_exception``); a daemon thread on every rank polls
that key and, when another rank's error appears, prints it and ends this process. The failing rank waits (a few
seconds at most) until every watcher has read the message, because the store may live in its own process: rank 0
hosts it under Lightning's launcher, and a store that dies with rank 0 would take the message with it. Under
torchrun's agent store (which outlives every rank) it does not wait: a peer killed outright never reads, and the
wait would only delay the restart.

Example:
    >>> watch_for_failures(rank)          # once per process, after the process group exists
    >>> announce_failure(rank, error)     # on the rank that raised, before it unwinds
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import sys
import threading
import time

import torch.distributed as dist

FAILURE_KEY = "lightscale/failure"
SEEN_KEY = "lightscale/failure_seen"  # how many watchers have read FAILURE_KEY
EXIT_CODE = 75  # "ended because another rank failed": tells a harness this is not the root cause
_MAX_MESSAGE = 2000  # characters of the error kept in the store (an exception may print a whole tensor)
_watching: set[int] = set()
_failed_here = threading.Event()  # this rank announced its own error: its watcher must not end it
_exiting = threading.Event()  # the interpreter is shutting down: the watcher must return first


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group (e.g. destroyed), or a store-less backend
        return None


def announce_failure(rank: int, error: BaseException, *, where: str = "", grace_s: float = 5.0) -> None:
    """Publish ``rank``'s error so every other rank stops (best effort: never masks the error itself).

    ``where`` (e.g. "fit, step 12") is appended to the message.

    Returns once every rank's watcher has read it, or after ``grace_s`` (a rank that is already gone never reads);
    at once when torchrun's agent hosts the store.
    """
    _failed_here.set()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        grace_s = 0.0  # the agent's store outlives this rank: every watcher can still read the message
    store = _store()
    if store is None:
        return
    message = f"rank {rank} raised {type(error).__name__}: {error}"[:_MAX_MESSAGE] + (f" [{where}]" if where else "")
    # The store may be gone (rank 0 died first): the error still propagates on this rank.
    with contextlib.suppress(Exception):
        store.set(FAILURE_KEY, message.encode())
        store.add(SEEN_KEY, 1)  # this rank has read it
        deadline = time.monotonic() + grace_s
        while store.add(SEEN_KEY, 0) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.05)


def watch_for_failures(rank: int, *, interval_s: float = 0.5) -> None:
    """Start (once per process) the thread that ends this rank when another rank announces a failure."""
    store = _store()
    if store is None or os.getpid() in _watching:
        return
    _watching.add(os.getpid())
    _failed_here.clear()  # a forked process inherits its parent's module state, not its parent's failure
    _exiting.clear()
    thread = threading.Thread(target=_watch, args=(store, rank, interval_s), name="lightscale-failure-watch")
    thread.daemon = True
    thread.start()
    # A daemon thread still inside a store call when the interpreter finalizes is killed mid-C++ (pthread_exit
    # unwinding through noexcept destructors: SIGABRT at a clean exit). Stop and join it before that.
    atexit.register(_stop_watching, thread, interval_s)


def _stop_watching(thread: threading.Thread, interval_s: float) -> None:
    _exiting.set()
    thread.join(timeout=interval_s + 5.0)


def _watch(store: dist.Store, rank: int, interval_s: float) -> None:
    while not _exiting.wait(interval_s) and not _failed_here.is_set():  # its own error: this rank is unwinding
        try:
            if not store.check([FAILURE_KEY]):
                continue
            message = store.get(FAILURE_KEY).decode()
            store.add(SEEN_KEY, 1)  # the announcing rank may now let the store go
        except Exception:  # the store went away (normal shutdown of rank 0): nothing left to watch
            return
        if _failed_here.is_set():
            return  # this rank failed too: it is unwinding with its own traceback
        print(f"lightscale: ending rank {rank} because {message}", file=sys.stderr, flush=True)
        # Where this rank was: if it was the one that stalled (the others timed out waiting for it), this is the report.
        print(f"lightscale: rank {rank} was here when it was ended:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_CODE)
