"""The failing rank's report: Python's whole traceback, rank-prefixed, printed once (one process; the launches are
tests/distributed/test_failure_traceback.py)."""

from __future__ import annotations

import json
import sys
import threading

import pytest

from lightscale.runtime import failure


def _user_code() -> None:
    try:
        {}["missing"]
    except KeyError as cause:
        raise ValueError("bad batch") from cause


def _caught() -> str:
    try:
        _user_code()
    except ValueError as error:  # where Lightning's on_exception runs: the outer frames are still live
        return failure.rank_traceback(3, error)
    raise AssertionError("unreachable")


def test_the_report_is_pythons_traceback_with_the_rank_on_every_line() -> None:
    report = _caught()
    lines = report.splitlines()
    assert all(line.startswith("[rank3]: ") for line in lines), report
    assert lines[-1] == "[rank3]: ValueError: bad batch"
    assert "in _user_code" in report and '{}["missing"]' in report  # the raising frame and its source line
    assert "in _caught" in report  # the handler's frame
    assert "in test_the_report_is_pythons_traceback_with_the_rank_on_every_line" in report  # outer frames too
    assert "[rank3]: KeyError: 'missing'" in report  # the chained cause
    assert report.index("in test_the_report") < report.index("in _caught") < report.rindex("in _user_code")


def test_the_excepthook_skips_only_the_error_already_printed() -> None:
    seen: list[BaseException] = []
    hook = failure._excepthook(3, lambda kind, error, tb: seen.append(error))
    printed, other = ValueError("printed"), ValueError("other")
    failure._printed[:] = [printed]
    try:
        hook(ValueError, printed, None)
        hook(ValueError, other, None)
    finally:
        failure._printed.clear()
    assert seen == [other]
    assert sys.excepthook is not hook  # nothing installed by the test itself


class _Recorder:
    """A store holding one timeout failure, and a stderr, both logging into ``events`` in call order."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def check(self, keys: list[str]) -> bool:
        return True

    def get(self, key: str) -> bytes:
        failure = {"message": "rank 0 raised DistBackendError: Timed out [train, step 2]", "timeout": True}
        return json.dumps(failure).encode()

    def add(self, key: str, value: int) -> int:
        self.events.append(f"add {key}")
        return 1

    def write(self, text: str) -> int:
        self.events.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_an_ended_rank_reports_before_it_lets_the_failing_rank_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under Lightning's launcher rank 0's exit kills the ranks it started: once rank 0 counts this rank as having read
    # its message it may exit, so this rank's report (where it stalled) must be out by then (issue 39: lost on a
    # loaded machine when the watcher counted itself first).
    events: list[str] = []
    recorder = _Recorder(events)

    def end(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(sys, "stderr", recorder)
    # This process's own state, fresh: an earlier test's fit that raised may have marked it as failed.
    monkeypatch.setattr(failure, "_failed_here", threading.Event())
    monkeypatch.setattr(failure, "_exiting", threading.Event())
    monkeypatch.setattr(failure, "_pending", [])  # an earlier test's handled failure would send the watcher elsewhere
    monkeypatch.setattr(failure.faulthandler, "dump_traceback", lambda **kwargs: events.append("stack"))
    monkeypatch.setattr(failure.os, "_exit", end)
    with pytest.raises(SystemExit) as ended:
        failure._watch(recorder, 1, 0.01)  # type: ignore[arg-type]
    assert ended.value.code == failure.EXIT_CODE
    report = "".join(event for event in events if not event.startswith("add "))
    assert report.startswith("lightscale: ending rank 1 because rank 0 raised") and "stack" in events
    assert events[-1] == f"add {failure.SEEN_KEY}", events  # counted as read last, after the stack
