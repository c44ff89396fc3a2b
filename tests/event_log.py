"""Events written by several processes and read back while they run.

Each process appends JSON lines to a file of its own, so that no line of one process can be cut into by another
or half-read while it is written: a reader keeps only the lines that end in a newline (a line being written, or
cut by SIGKILL, is not one yet) and orders the events of all processes by the time they were written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def event_writer(directory: Path | str, **common: Any) -> Callable[..., None]:
    """A function ``write(event, **fields)`` appending one line per event to this process's own file."""
    log = open(Path(directory) / f"{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the process

    def write(event: str, **fields: Any) -> None:
        record = {"event": event, "pid": os.getpid(), "t": time.monotonic(), **common, **fields}
        log.write(json.dumps(record) + "\n")

    return write


def read_events(directory: Path) -> list[dict[str, Any]]:
    """Every complete event written so far under ``directory``, oldest first."""
    events = []
    for path in directory.glob("*.jsonl"):
        *complete, _unfinished = path.read_text().split("\n")
        events += [json.loads(line) for line in complete]
    return sorted(events, key=lambda e: e["t"])


def wait_for(predicate: Callable[[], Any], what: str, deadline: float) -> None:
    """Poll ``predicate`` until it holds; a ``TimeoutError`` naming ``what`` past ``deadline`` (time.monotonic())."""
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
