"""The fault-tolerance tests' event log: a line still being written (or cut by SIGKILL) is not read."""

from __future__ import annotations

import json
from pathlib import Path

from event_log import event_writer, read_events


def test_only_complete_lines_are_read_in_time_order(tmp_path: Path) -> None:
    write = event_writer(tmp_path, replica=0)
    write("start")
    write("round", round=0)
    other = tmp_path / "99999999.jsonl"  # another process: one complete line, one cut in the middle
    complete = json.dumps({"event": "round", "pid": 99999999, "t": 0.0, "replica": 1, "round": 0})
    other.write_text(complete + "\n" + complete[:20])
    events = read_events(tmp_path)
    assert [(e["event"], e["replica"]) for e in events] == [("round", 1), ("start", 0), ("round", 0)]
