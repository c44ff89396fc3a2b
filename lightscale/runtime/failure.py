"""When one rank raises, every rank stops within seconds and says which rank failed and why.

Without this, the other ranks wait inside their next collective until its timeout (NCCL does not notice a dead
peer; gloo does, but reports only "Connection closed by peer"). The failing rank writes its error into the
process group's key-value store (Lightning calls ``Strategy.on_exception``); a daemon thread on every rank polls
that key and, when another rank's error appears, prints it and ends this process. The failing rank first prints its
own traceback, each line prefixed ``[rankK]: `` as torch's excepthook does, because a peer that ends (rank 0, under
Lightning's launcher, takes every rank it started with it) may end this rank before Python would print it at exit.
Only when the failure is a collective timeout does an ended rank print its threads' stacks: it may be the rank that
stalled, and then that stack is the report; a rank ended by another rank's exception did nothing wrong.

The failing rank waits (a few seconds at most) until every watcher has read the message and printed its report,
because the store may live in its own process: rank 0 hosts it under Lightning's launcher, and a store that dies with
rank 0 would take the message with it (and rank 0's exit ends the ranks it started, their reports with them). Under
torchrun's agent store (which outlives every rank) it does not wait: a peer killed outright never reads, and the wait
would only delay the restart.

Example:
    >>> watch_for_failures(rank)          # once per process, after the process group exists
    >>> announce_failure(rank, error)     # on the rank that raised, before it unwinds

Exit codes: the rank that raised exits as Python does (1); a rank ended because another rank failed exits
``EXIT_CODE`` (75); a rank whose launcher died is killed (SIGKILL, -9 / 137). docs/faults.md shows an example output.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch.distributed as dist

FAILURE_KEY = "lightscale/failure"
SEEN_KEY = "lightscale/failure_seen"  # how many watchers have read FAILURE_KEY
EXIT_CODE = 75  # "ended because another rank failed": tells a harness this is not the root cause
_MAX_MESSAGE = 2000  # characters of the error kept in the store (an exception may print a whole tensor)
_watching: set[int] = set()
_failed_here = threading.Event()  # this rank announced its own error: its watcher must not end it
_exiting = threading.Event()  # the interpreter is shutting down: the watcher must return first
_printed: list[BaseException] = []  # the error whose traceback this rank printed: the excepthook skips it


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no default group (e.g. destroyed), or a store-less backend
        return None


def is_timeout(error: BaseException) -> bool:
    """A collective (or the store) gave up waiting: some rank may be stalled, not failed."""
    return isinstance(error, TimeoutError) or "Timed out" in str(error)


def rank_traceback(rank: int, error: BaseException) -> str:
    """The traceback Python prints for an uncaught ``error`` (outer frames, chained causes), each line prefixed
    ``[rank<rank>]: `` like torch's excepthook. Called while the error is being handled, the frames from the
    program's entry to the handler are still live and lead the traceback, as they would at exit."""
    report = traceback.TracebackException.from_exception(error)
    handler = error.__traceback__.tb_frame if error.__traceback__ is not None else None
    if handler is not None and handler.f_back is not None:
        outer = traceback.StackSummary.extract(traceback.walk_stack(handler.f_back))
        outer.reverse()  # walk_stack goes innermost first; a traceback reads outermost first
        report.stack = traceback.StackSummary.from_list([*outer, *report.stack])
    lines = "".join(report.format()).rstrip("\n").split("\n")
    return "".join(f"[rank{rank}]: {line}\n" for line in lines)


def announce_failure(rank: int, error: BaseException, *, where: str = "", grace_s: float = 5.0) -> None:
    """Print ``rank``'s traceback and a one-line summary, then publish the summary so every other rank stops (best
    effort: never masks the error itself).

    ``where`` (e.g. "fit, step 12") is appended to the summary, which the other ranks print as they end.

    Returns once every rank's watcher has read it, or after ``grace_s`` (a rank that is already gone never reads);
    at once when torchrun's agent hosts the store.
    """
    _failed_here.set()
    first_line = (str(error).splitlines() or [""])[0]  # a DataLoader worker's error carries a whole traceback
    message = f"rank {rank} raised {type(error).__name__}: {first_line}"[:_MAX_MESSAGE]
    message += f" [{where}]" if where else ""
    # Only where a watcher runs (peers exist, the hook that skips Python's own report is in place); Ctrl+C reaches
    # every rank: no rank's stack is the cause.
    if os.getpid() in _watching and not isinstance(error, KeyboardInterrupt):
        # Printed now, not at exit: a peer that ends may take this rank with it (PDEATHSIG, torchrun's SIGTERM).
        sys.stderr.write(rank_traceback(rank, error) + f"lightscale: {message}\n")
        sys.stderr.flush()
        _printed[:] = [error]
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        grace_s = 0.0  # the agent's store outlives this rank: every watcher can still read the message
    store = _store()
    if store is None:
        return
    payload = json.dumps({"message": message, "timeout": is_timeout(error)})
    # The store may be gone (rank 0 died first): the error still propagates on this rank.
    with contextlib.suppress(Exception):
        store.set(FAILURE_KEY, payload.encode())
        store.add(SEEN_KEY, 1)  # this rank has read it
        deadline = time.monotonic() + grace_s
        while store.add(SEEN_KEY, 0) < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.05)


_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def _excepthook(previous: _ExceptHook) -> _ExceptHook:
    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if _printed and error is _printed[0]:
            return  # announce_failure printed it, with the rank and the outer frames, before the peers ended
        previous(kind, error, tb)

    return hook


def watch_for_failures(rank: int, *, interval_s: float = 0.5) -> None:
    """Start (once per process) the thread that ends this rank when another rank announces a failure."""
    store = _store()
    if store is None or os.getpid() in _watching:
        return
    _watching.add(os.getpid())
    _failed_here.clear()  # a forked process inherits its parent's module state, not its parent's failure
    _exiting.clear()
    _printed.clear()
    sys.excepthook = _excepthook(sys.excepthook)  # after init_process_group: wraps torch's [rankK] prefixing hook
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
        except Exception:  # the store went away (normal shutdown of rank 0): nothing left to watch
            return
        if _failed_here.is_set():  # this rank failed too: it is unwinding with its own traceback
            with contextlib.suppress(Exception):
                store.add(SEEN_KEY, 1)
            return
        _end(rank, message, store)


def _end(rank: int, payload: str, store: dist.Store) -> None:
    failure = json.loads(payload)
    print(f"lightscale: ending rank {rank} because {failure['message']}", file=sys.stderr, flush=True)
    if failure["timeout"]:
        # Another rank timed out waiting for this one, which may be the one that stalled: where it was is the report.
        print(f"lightscale: rank {rank} was here when it was ended:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    # Read only now, once the report is out: the announcing rank may then exit, and under Lightning's launcher rank 0's
    # exit kills this rank (PDEATHSIG), on a loaded machine before a report printed after this line.
    with contextlib.suppress(Exception):
        store.add(SEEN_KEY, 1)
    os._exit(EXIT_CODE)
