"""When one rank's error ends the run, every rank stops within seconds and says which rank failed and why; an
error the script handles on every rank (``except`` around ``trainer.fit``: Optuna's pruning, ``pytest.raises``) is
left to the script, silently.

Without this, the other ranks wait inside their next collective until its timeout (NCCL does not notice a dead
peer; gloo does, but reports only "Connection closed by peer"). When an error leaves ``fit`` (Lightning calls
``Strategy.on_exception``) the rank only *records* it (:func:`record_failure`): its traceback, taken while the frames
from the program's entry are still live, and a count in the process group's key-value store of the ranks that raised.
The rank *announces* it - prints its traceback, each line prefixed ``[rankK]: `` as torch's excepthook does, and a
one-line summary, then writes the summary into the store, where a daemon thread on every other rank reads it,
prints it and ends its process - when one of these happens first:

* the error escapes the process (``sys.excepthook``): the script did not handle it;
* ``PENDING_S`` seconds pass and some rank has not raised as well: that rank is waiting in a collective for this
  one (the script handled the error on this rank only, or is still unwinding); the watcher announces it;
* the process exits with the error handled while some rank has not raised (checked at exit, waiting up to
  ``PENDING_S`` for it).

An error every rank raised and the script handles is therefore never announced and prints nothing. The traceback is
printed before the other ranks are told, because a peer that ends (rank 0, under Lightning's launcher, takes every
rank it started with it) may end this rank before Python would print it at exit; Python's own report of the same
error is then skipped. Only when the failure is a collective timeout does an ended rank print its threads' stacks:
it may be the rank that stalled, and then that stack is the report; a rank ended by another rank's exception did
nothing wrong.

The announcing rank waits (a few seconds at most) until every watcher has read the message and printed its report,
because the store may live in its own process: rank 0 hosts it under Lightning's launcher, and a store that dies with
rank 0 would take the message with it (and rank 0's exit ends the ranks it started, their reports with them). Under
torchrun's agent store (which outlives every rank) it does not wait: a peer killed outright never reads, and the wait
would only delay the restart.

Example:
    >>> watch_for_failures(rank)                        # once per process, after the process group exists
    >>> record_failure(rank, error, where="train, step 3")  # on the rank that raised, while it unwinds

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
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist

from lightscale.patches.process import wrap_excepthook

FAILURE_KEY = "lightscale/failure"
SEEN_KEY = "lightscale/failure_seen"  # how many watchers have read FAILURE_KEY
RAISED_KEY = "lightscale/raised"  # + "/<n>": how many ranks recorded their n-th failure
EXIT_CODE = 75  # "ended because another rank failed": tells a harness this is not the root cause
# How long a recorded failure waits for every rank to raise as well before the ranks that did not are told: ranks
# raising together (a synced value, a broadcast decision) reach it within milliseconds, a loaded machine's within a
# second or two.
PENDING_S = 5.0
_MAX_MESSAGE = 2000  # characters of the error kept in the store (an exception may print a whole tensor)
_watching: set[int] = set()
_failed_here = threading.Event()  # this rank announced its own error: its watcher must not end it
_exiting = threading.Event()  # the interpreter is shutting down: the watcher must return first
_printed: list[BaseException] = []  # the error whose traceback this rank printed: the excepthook skips it
_lock = threading.Lock()  # one announcement per process (the watcher thread, the excepthook, atexit)


@dataclass
class _Pending:
    """A failure that left ``fit`` on this rank and has not been announced: the script may handle it."""

    rank: int
    error: BaseException
    where: str
    report: str  # its traceback, taken while the frames from the program's entry were live
    count: int  # this rank's n-th failure: RAISED_KEY/<n> counts the ranks that raised with it
    since: float
    shared: bool = False  # every rank raised it (known once PENDING_S passed): nobody waits for this rank


_pending: list[_Pending] = []
_raised = [0]  # failures recorded by this process


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


def record_failure(rank: int, error: BaseException, *, where: str = "") -> None:
    """``error`` is leaving ``fit`` (``validate``, ...) on ``rank``: keep its report for an announcement and count
    it in the store, so that an error every rank raises and the script handles is never announced (see the module
    docstring). Ctrl+C reaches every rank and no rank's stack is the cause: announced at once, without a traceback.
    Best effort: never masks the error itself."""
    if isinstance(error, KeyboardInterrupt):
        announce_failure(rank, error, where=where, report="")
        return
    _raised[0] += 1
    pending = _Pending(rank, error, where, rank_traceback(rank, error), _raised[0], time.monotonic())
    _pending[:] = [pending]
    store = _store()
    if store is not None:
        with contextlib.suppress(Exception):
            store.add(f"{RAISED_KEY}/{pending.count}", 1)


def announce_failure(
    rank: int, error: BaseException, *, where: str = "", report: str | None = None, grace_s: float = 5.0
) -> None:
    """Print ``rank``'s traceback (``report``, else taken now) and a one-line summary, then publish the summary so
    every other rank stops (best effort: never masks the error itself). Once per process.

    ``where`` (e.g. "fit, step 12") is appended to the summary, which the other ranks print as they end.

    Returns once every rank's watcher has read it, or after ``grace_s`` (a rank that is already gone never reads);
    at once when torchrun's agent hosts the store.
    """
    with _lock:
        if _failed_here.is_set():
            return  # announced already (the watcher thread, or the error escaped after the watcher told the others)
        _failed_here.set()
    _pending.clear()
    first_line = (str(error).splitlines() or [""])[0]  # a DataLoader worker's error carries a whole traceback
    message = f"rank {rank} raised {type(error).__name__}: {first_line}"[:_MAX_MESSAGE]
    message += f" [{where}]" if where else ""
    # Only where a watcher runs (peers exist, the hook that skips Python's own report is in place); Ctrl+C reaches
    # every rank: no rank's stack is the cause.
    if os.getpid() in _watching and not isinstance(error, KeyboardInterrupt):
        # Printed now, not at exit: a peer that ends may take this rank with it (PDEATHSIG, torchrun's SIGTERM).
        sys.stderr.write((rank_traceback(rank, error) if report is None else report) + f"lightscale: {message}\n")
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


def report_escaped(rank: int, error: BaseException) -> None:
    """``error`` escapes this rank's program (the excepthook; a test harness's rank): announce it, with the report
    and place recorded when it left ``fit`` if it is that error or was raised from it."""
    if _failed_here.is_set():
        return  # announced already, or being ended
    store = _store()
    with contextlib.suppress(Exception):
        if store is not None and store.check([FAILURE_KEY]):  # another rank announced first: this error follows it
            message = store.get(FAILURE_KEY).decode()
            _failed_here.set()
            _end(rank, message, store)  # as the watcher would have, had it polled before this rank's collective broke
    pending = _pending[0] if _pending else None
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and len(chain) < 16:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if pending is not None and any(link is pending.error for link in chain):
        # Raised from it (or while handling it, e.g. in teardown): the summary names the error that left fit, the
        # traceback is the whole chain Python would print.
        report = pending.report if error is pending.error else rank_traceback(rank, error)
        announce_failure(rank, pending.error, where=pending.where, report=report)
    else:
        announce_failure(rank, error)
    if _printed:
        _printed[:] = [error]  # printed: Python's own report of it is skipped


def _unshared(pending: _Pending, store: dist.Store) -> bool:
    """Some rank has not raised with ``pending``: it is waiting for this one (or is slower to raise)."""
    return store.add(f"{RAISED_KEY}/{pending.count}", 0) < dist.get_world_size()


def settle_failures(*, wait_s: float = PENDING_S) -> None:
    """At exit (and where a harness ends a rank): a failure this rank handled while some rank never raised it is
    announced, after waiting up to ``wait_s`` from when it was recorded for that rank to raise too."""
    pending = _pending[0] if _pending else None
    store = _store()
    if pending is None or pending.shared or store is None or _failed_here.is_set():
        return
    with contextlib.suppress(Exception):
        deadline = pending.since + wait_s
        while _unshared(pending, store) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _unshared(pending, store):
            announce_failure(pending.rank, pending.error, where=pending.where, report=pending.report)


_ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], Any]


def _excepthook(rank: int, previous: _ExceptHook) -> _ExceptHook:
    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if _printed and error is _printed[0]:
            return  # announce_failure printed it, with the rank and the outer frames, before the peers ended
        if not isinstance(error, KeyboardInterrupt) and _store() is not None:
            report_escaped(rank, error)  # the script did not handle it: every rank is told
            if _printed and error is _printed[0]:
                return
        previous(kind, error, tb)

    return hook


def watch_for_failures(rank: int, *, interval_s: float = 0.5) -> None:
    """Start (once per process) the thread that ends this rank when another rank announces a failure, and that
    announces this rank's recorded failure when some rank is still waiting for it after ``PENDING_S``."""
    store = _store()
    if store is None or os.getpid() in _watching:
        return
    _watching.add(os.getpid())
    _failed_here.clear()  # a forked process inherits its parent's module state, not its parent's failure
    _exiting.clear()
    _printed.clear()
    _pending.clear()
    _raised[0] = 0
    wrap_excepthook(lambda hook: _excepthook(rank, hook))  # after init_process_group: wraps torch's [rankK] hook
    thread = threading.Thread(target=_watch, args=(store, rank, interval_s), name="lightscale-failure-watch")
    thread.daemon = True
    thread.start()
    # A daemon thread still inside a store call when the interpreter finalizes is killed mid-C++ (pthread_exit
    # unwinding through noexcept destructors: SIGABRT at a clean exit). Stop and join it before that.
    atexit.register(_stop_watching, thread, interval_s)
    atexit.register(settle_failures)  # runs first (atexit is last-in, first-out), while the watcher still runs


def _stop_watching(thread: threading.Thread, interval_s: float) -> None:
    _exiting.set()
    thread.join(timeout=interval_s + 5.0)


def _watch(store: dist.Store, rank: int, interval_s: float) -> None:
    while not _exiting.wait(interval_s) and not _failed_here.is_set():  # its own error: this rank is unwinding
        try:
            pending = _pending[0] if _pending else None
            if pending is not None and not pending.shared and time.monotonic() - pending.since > PENDING_S:
                if _unshared(pending, store):  # a rank is still waiting for this one
                    announce_failure(pending.rank, pending.error, where=pending.where, report=pending.report)
                    return
                pending.shared = True  # every rank raised it: the script's to handle, nobody waits
            if not store.check([FAILURE_KEY]):
                continue
            message = store.get(FAILURE_KEY).decode()
        except Exception:  # the store went away (normal shutdown of rank 0): nothing left to watch
            return
        with _lock:
            if _failed_here.is_set():  # this rank is announcing its own error: it reports with its own traceback
                with contextlib.suppress(Exception):
                    store.add(SEEN_KEY, 1)
                return
            _failed_here.set()  # nothing this rank raises from now on is announced: it is being ended
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
