"""The behaviour dump equals the one stored before the reorganisation (tests/behaviour_dump.py says what it holds).

The dump runs in a fresh interpreter: a strategy class another test registered, or a seed it set, would change the
answers of this process, not lightscale's. On a mismatch the message lists every differing key path with both values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "tests" / "assets" / "behaviour_7ca1c58.json"
SHOWN = 40  # differences printed in full; the rest are counted


def flatten(value: Any, path: str = "") -> dict[str, Any]:
    """``{"a": {"b": [1]}}`` -> ``{"a/b/0": 1}``: one entry per leaf (an empty dict or list is a leaf)."""
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{path}/{key}").items()}
    if isinstance(value, list) and value:
        return {k: v for index, item in enumerate(value) for k, v in flatten(item, f"{path}/{index}").items()}
    return {path or "/": value}


def differences(expected: Any, actual: Any) -> list[str]:
    """Readable lines for every leaf that differs, is missing or is new, in key order."""
    old, new = flatten(expected), flatten(actual)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key not in new:
            lines.append(f"- {key}: {old[key]!r} (gone)")
        elif key not in old:
            lines.append(f"+ {key}: {new[key]!r} (new)")
        elif old[key] != new[key]:
            lines.append(f"~ {key}:\n    stored: {old[key]!r}\n    now:    {new[key]!r}")
    return lines


def test_differences_name_the_key_path() -> None:
    assert differences({"a": {"b": [1, 2]}, "c": 1}, {"a": {"b": [1, 3]}, "d": 1}) == [
        "~ /a/b/1:\n    stored: 2\n    now:    3",
        "- /c: 1 (gone)",
        "+ /d: 1 (new)",
    ]
    assert differences({"x": 0.0}, {"x": 0}) == []  # the same number, whether stored as int or float


def test_behaviour_is_the_stored_behaviour() -> None:
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]  # this checkout's code
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "behaviour_dump.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = differences(json.loads(STORED.read_text()), json.loads(run.stdout))
    if lines:  # pytest.fail: the message alone, without the assertion's repr of the whole list
        more = f"\n... and {len(lines) - SHOWN} more" if len(lines) > SHOWN else ""
        pytest.fail(
            f"{len(lines)} answers differ from {STORED.name} (a refactor must keep them; a meant change regenerates "
            "it, see tests/behaviour_dump.py):\n" + "\n".join(lines[:SHOWN]) + more,
            pytrace=False,
        )
