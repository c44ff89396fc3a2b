"""The failing rank's report: Python's whole traceback, rank-prefixed, printed once (one process; the launches are
tests/distributed/test_failure_traceback.py)."""

from __future__ import annotations

import sys

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
