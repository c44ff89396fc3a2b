"""One function in a child process, bounded in time: what ``make gpu-check``'s checks (benchmarks/gpu_check.py) and
their workers (benchmarks/gpu_workers.py, the offload search's probes) share, so neither imports the other.

    $ python benchmarks/gpu_isolated.py MODULE:FUNCTION ARGS_JSON OUT   # the child side; isolated() runs it
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def isolated(target: str, *args: Any, timeout: float) -> dict[str, Any]:
    """Run ``module:function(*args)`` in a child process, at most ``timeout`` seconds; its JSON-able return value,
    or ``{"error": traceback tail}`` when it raised, crashed or ran out of time."""
    if timeout < 2:
        return {"error": "not started: no time left", "not_started": True}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), target, json.dumps(args), str(out)]
        try:
            returncode, stdout, stderr = run_killable(command, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            return {"error": f"timed out after {timeout:.0f} s\n{tail(str(expired.output or ''))}"}
        if out.exists():
            return json.loads(out.read_text())
        return {"error": f"exit status {returncode}, no result\n{tail(stderr or stdout)}"}


def run_killable(command: list[str], *, timeout: float, cwd: Path | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``command``; on time-out its whole session is killed (compile workers, the
    offload search's probes, pytest's CLI runs: nothing is left holding the GPU) and TimeoutExpired raised."""
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = child.communicate(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=stderr or stdout) from None
    return child.returncode, stdout, stderr


def _env() -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    return {**keep, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def worker(target: str, args_json: str, out: str) -> None:
    """Child side of :func:`isolated`: the result (or the traceback) goes to ``out`` as JSON."""
    module, _, function = target.partition(":")
    try:
        value = getattr(importlib.import_module(module), function)(*json.loads(args_json))
        result = value if isinstance(value, dict) else {"value": value}
    except BaseException:  # everything (CUDA errors, SystemExit) is the check's failure
        result = {"error": tail(traceback.format_exc())}
    Path(out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    worker(*sys.argv[1:4])
